"""What ``check_op`` reports: the summary of the checks that passed and were skipped, and its failure type."""

from __future__ import annotations

import dataclasses

__all__ = ["OpCheck"]


@dataclasses.dataclass
class OpCheck:
    """What ``check_op`` checked: one entry per check, with its measured error and tolerance.

    ``checks`` holds the checks that passed; ``skipped`` says, for each check
    that was not run or could not be meaningful, why. :func:`jaxbind.testing.check_op`
    returns one; ``print`` it for a table, one line per check. A dataclass:
    its constructor takes the attributes below.

    Parameters
    ----------
    op : str
        The name of the op checked.
    kind : str
        Its kind: ``"linear"``, ``"multilinear"`` or ``"nonlinear"``.
    checks : list of dict, optional
        The checks that passed (default: none yet), each a dict with the keys
        ``check`` (what was checked), ``argument`` (the argument, and output,
        it was about), ``error`` (the measured error, relative to the
        magnitude of what was compared) and ``tolerance`` (its tolerance); the
        worst of each group.
    skipped : list of str, optional
        What was not checked and why (default: none), e.g. the derivatives of
        an op made without them, or a comparison the precision makes
        meaningless.
    """

    op: str
    kind: str
    checks: list[dict] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)

    def add(self, check: str, argument: str, error: float, tolerance: float):
        """Record a check that passed (used by :func:`jaxbind.testing.check_op`).

        Parameters
        ----------
        check : str
            What was checked.
        argument : str
            The argument (and output) it was about.
        error : float
            The measured error, relative to the magnitude of what was compared.
        tolerance : float
            Its tolerance, on the same scale.
        """
        self.checks.append(dict(check=check, argument=argument, error=float(error), tolerance=float(tolerance)))

    def skip(self, text: str):
        """Record a check that was skipped, with the reason (once per text; used by :func:`jaxbind.testing.check_op`).

        Parameters
        ----------
        text : str
            What was not checked, and why.
        """
        if text not in self.skipped:
            self.skipped.append(text)

    def __str__(self):
        lines = [
            f"check_op: jaxbind {self.kind} op '{self.op}': {len(self.checks)} checks passed"
            + (f", {len(self.skipped)} skipped" if self.skipped else "")
        ]
        lines += [
            f"  {c['check']:<44} {c['argument']:<40} error {c['error']:.1e} <= {c['tolerance']:.1e}"
            for c in self.checks
        ]
        lines += [f"  skipped: {s}" for s in self.skipped]
        return "\n".join(lines)

    __module__ = "jaxbind.testing"


class Failure(AssertionError):
    """A failed check (an AssertionError naming the op, the check and the argument)."""
