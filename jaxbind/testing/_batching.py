"""Checks under vmap: one and two levels, of the op, its vjp and its jvp (what jacfwd runs), against loops."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from .. import _trampoline
from ._numerics import BATCH, COMBINED, NESTED, _inexact, _size

# The thread-safety check: a walk of this many elements, spread over every thread in chunks of a
# few elements, with Python switching threads as often as it can, run this many times.
SPREAD_ELEMENTS = 256
SPREAD_RUNS = 3


class BatchingChecks:
    """vmap at one and two levels of the op, its vjp and its jvp, against loops (mixed into the checker)."""

    def element(self, k):
        """Element ``k`` of the batches: the given arguments, perturbed (inexact ones) for k > 0.

        Fixed arguments are parameters whose structure an op may rely on (a
        monotonic time grid, a sign pattern): they are scaled as a whole.
        """
        if k in self.elements:
            return list(self.elements[k])
        rng = np.random.default_rng(100 + k)
        out = []
        for i, a in enumerate(self.args):
            if k and _inexact(a.dtype) and a.size:
                noise = 0.4 * k if i < self.n_fixed else rng.standard_normal(a.shape)
                a = a * jnp.asarray(1 + 0.05 * noise).astype(a.dtype)
            out.append(a)
        self.elements[k] = out
        return list(out)

    def batched(self, check, label, fn, items, axes, dtypes, detail):
        """A task: ``fn`` vmapped over the levels of ``axes`` (outer first) against a loop over ``items``.

        ``items[k1][k2]...`` are argument lists; an argument whose axis is None
        at a level takes the value of that level's element 0.
        """
        sizes = []
        level = items
        for _ in axes:
            sizes.append(len(level))
            level = level[0]
        n = len(axes[0])

        def value(i, ks):
            item = items
            for depth, k in enumerate(ks):
                item = item[0 if axes[depth][i] is None else k]
            return item[i]

        def build(i, depth, ks):
            if depth == len(axes):
                return value(i, ks)
            if axes[depth][i] is None:
                return build(i, depth + 1, ks + [0])
            return jnp.stack([build(i, depth + 1, ks + [k]) for k in range(sizes[depth])], axis=axes[depth][i])

        mapped = fn
        for a in reversed(axes):
            mapped = jax.vmap(mapped, in_axes=tuple(a))

        def loop(depth=0, ks=()):
            if depth == len(axes):
                return fn(*[value(i, list(ks)) for i in range(n)])
            rows = [loop(depth + 1, ks + (k,)) for k in range(sizes[depth])]
            return [jnp.stack([r[m] for r in rows]) for m in range(len(rows[0]))]

        return dict(
            check=check,
            label=label,
            mapped=mapped,
            inputs=lambda: [build(i, 0, []) for i in range(n)],
            loop=loop,
            dtypes=dtypes,
            detail=detail,
        )

    def run_batched(self, tasks):
        """Run the tasks' vmapped functions, compiled together (one program), and compare each with its loop.

        If the program fails, each task runs on its own, so that the failure
        names the one that raised. Large arguments run task by task, so that
        the results of one are freed before the next runs.
        """
        results = None
        size = sum(
            _size(a) * (2 if t["check"] == "vmap of vmap against a loop" else 1) for t in tasks for a in self.args
        )
        if size * BATCH <= COMBINED:
            try:
                results = jax.jit(lambda inputs: [t["mapped"](*i) for t, i in zip(tasks, inputs)])(
                    [t["inputs"]() for t in tasks]
                )
                jax.block_until_ready(results)
            except Exception:
                results = None
        for k, t in enumerate(tasks):
            check, label = t["check"], t["label"]
            got = (
                results[k]
                if results is not None
                else self.attempt(check, label, lambda t=t: jax.jit(t["mapped"])(*t["inputs"]()))
            )
            want = self.attempt(check, label + " (the loop)", t["loop"])
            if len(got) != len(want):
                self.fail(check, label, f"{t['detail']}: {len(got)} results, the loop gives {len(want)}")
            self.compare_all(check, label, got, want, t["dtypes"], t["detail"])
            del got, want
            if results is not None:
                results[k] = None

    def grid(self, sizes, extra=None):
        """Nested lists of element argument lists (plus ``extra(k)`` appended), element k = flat index."""

        def make(depth, offset):
            if depth == len(sizes):
                return self.element(offset) + (extra(offset) if extra else [])
            stride = int(np.prod(sizes[depth + 1 :], dtype=np.int64))
            return [make(depth + 1, offset + k * stride) for k in range(sizes[depth])]

        return make(0, 0)

    def check_vmap(self):
        d = self.definition
        n = len(self.args)
        dtypes = [o.dtype for o in self.outs]
        ones = [min(1, a.ndim) for a in self.args]
        patterns = [("in_axes 0", [0] * n), ("in_axes 1", ones)]
        if n > 1:
            patterns.append(("in_axes None-mixed", [None if i % 2 == 0 else 0 for i in range(n)]))
            patterns.append(("in_axes None-mixed", [0 if i % 2 == 0 else None for i in range(n)]))
        check = "vmap against a Python loop"
        detail = "the vmapped op gives other values than calling it element by element"
        items = self.grid([BATCH])
        tasks = [
            self.batched(check, f"{name} {tuple(axes)}", self.call, items, [axes], dtypes, detail)
            for name, axes in patterns
        ]
        if n == 1:
            # The op inside a vmap over something else (a scale of its outputs).

            def scale(s, *args):
                return [s * o if _inexact(o.dtype) else o for o in self.call(*args)]

            scaled = self.grid([BATCH], lambda k: [jnp.asarray(1.0 + k)])
            scaled = [item[-1:] + item[:-1] for item in scaled]
            tasks.append(self.batched(check, "in_axes None-mixed (None,)", scale, scaled, [[0, None]], dtypes, detail))

        # Two levels: every argument at both (the inner at axis 1); then some at both, the others
        # at the inner level only (jaxbind broadcasts those over the outer one).
        check = "vmap of vmap against a loop"
        nested = [("outer 0, inner 1", [[0] * n, ones])]
        if n > 1:
            nested.append(
                ("outer None-mixed, inner 1", [[a if i % 2 == 0 else None for i, a in enumerate(ones)], ones])
            )
        items2 = self.grid(list(NESTED))
        tasks += [
            self.batched(check, f"{name} {tuple(axes[0])} {tuple(axes[1])}", self.call, items2, axes, dtypes, detail)
            for name, axes in nested
        ]

        diff = [i for i in range(self.n_fixed, n) if _inexact(self.args[i].dtype)]
        if d.has_derivatives and diff and self.inexact_outputs:
            tasks += self.vmap_of_vjp_tasks(patterns, diff)
            if d.kind == "nonlinear":
                tasks += self.batched_jvp_tasks(diff, ones)
        self.run_batched(tasks)

    def check_thread_safe(self):
        """A ``thread_safe`` op's vmap walked on every thread at once, against calling it element by element.

        Nothing can prove a body thread-safe; this makes a race likely enough to be seen: every walk
        is spread over XLA's threads in chunks of a few elements, however short they are, and Python
        switches threads every microsecond (``sys.setswitchinterval``), so that two calls interleave
        wherever a body shares state between calls.
        """
        check = "thread_safe: the walk on several threads against a loop"
        detail = (
            "the vmapped op gives other values when its walk runs on several threads at once than "
            "called element by element: the op was made with thread_safe=True, but its callback is "
            "not thread-safe (calls share state: a scratch array, a global, an attribute of an "
            "object); give each call its own state, or make the op with thread_safe=False"
        )
        n = len(self.args)
        task = self.batched(
            check, "in_axes 0", self.call, self.grid([SPREAD_ELEMENTS]), [[0] * n], [o.dtype for o in self.outs], detail
        )
        interval = sys.getswitchinterval()
        _trampoline.set_spread_walks(True)
        sys.setswitchinterval(1e-6)
        try:
            for _ in range(SPREAD_RUNS):
                self.run_batched([task])
        finally:
            sys.setswitchinterval(interval)
            _trampoline.set_spread_walks(False)

    def restrict(self, args, diff):
        """f of the arguments ``diff``, the others held at ``args``."""
        return lambda *dv: self.call(*[dv[diff.index(i)] if i in diff else a for i, a in enumerate(args)])

    def vmap_of_vjp_tasks(self, patterns, diff):
        n = len(self.args)
        outs = self.inexact_outputs

        def vjp(*values):
            args, cts = values[:n], values[n:]
            pullback = jax.vjp(self.restrict(args, diff), *[args[i] for i in diff])[1]
            return list(pullback(self.zero_cotangents(dict(zip(outs, cts)))))

        def cotangents(k):
            return [self.random(self.outs[j].shape, self.outs[j].dtype) for j in outs]

        items = self.grid([BATCH], cotangents)
        dtypes = [self.args[i].dtype for i in diff]
        return [
            self.batched(
                "vmap of the vjp against a loop",
                f"{name} {tuple(axes)}",
                vjp,
                items,
                [list(axes) + [0] * len(outs)],
                dtypes,
                "the vmapped vjp gives other values than calling it element by element",
            )
            for name, axes in patterns
            if any(a is not None for a in axes)
        ]

    def batched_jvp_tasks(self, diff, ones):
        """f_jvp batched: vmap of the jvp over tangents (jacfwd), over primals and tangents, jvp of vmap."""
        n = len(self.args)
        outs = self.inexact_outputs
        dtypes = [self.outs[j].dtype for j in outs]
        check = "batched jvp against a loop"
        detail = "the batched jvp gives other values than the jvp element by element"

        def jvp(*values):
            args, ts = values[:n], values[n:]
            tangents = jax.jvp(self.restrict(args, diff), tuple(args[i] for i in diff), tuple(ts))[1]
            return [tangents[j] for j in outs]

        def tangents(k):
            return [self.random(self.args[i].shape, self.args[i].dtype) for i in diff]

        items = self.grid([BATCH], tangents)
        all_ones = [ones[i] for i in range(n)] + [ones[i] for i in diff]
        tasks = [
            # vmap over the tangents at fixed primals: what jax.jacfwd does
            self.batched(
                check,
                "vmap of jvp, tangents batched (jacfwd)",
                jvp,
                items,
                [[None] * n + [0] * len(diff)],
                dtypes,
                detail,
            ),
            self.batched(check, f"vmap of jvp, in_axes {tuple(all_ones)}", jvp, items, [all_ones], dtypes, detail),
        ]
        # jvp of vmap: the op vmapped (some fixed arguments unmapped), then differentiated
        in_axes = [None if i < self.n_fixed and i % 2 == 0 else 0 for i in range(n)]

        def jvp_of_vmap(*values):
            args, ts = values[:n], values[n:]

            def f(*dv):
                return jax.vmap(self.call, in_axes=tuple(in_axes))(
                    *[dv[diff.index(i)] if i in diff else a for i, a in enumerate(args)]
                )

            tangents_out = jax.jvp(f, tuple(args[i] for i in diff), tuple(ts))[1]
            return [tangents_out[j] for j in outs]

        task = self.batched(
            check, f"jvp of vmap, in_axes {tuple(in_axes)}", jvp, items, [in_axes + [0] * len(diff)], dtypes, detail
        )

        def inputs():
            stacked = [jnp.stack([items[k][i] for k in range(BATCH)]) for i in range(n + len(diff))]
            return [stacked[i] if i >= n or in_axes[i] == 0 else items[0][i] for i in range(n + len(diff))]

        task.update(mapped=jvp_of_vmap, inputs=inputs)  # the loop stays the jvp element by element
        tasks.append(task)
        return tasks
