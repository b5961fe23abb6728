/*
 * Native kernels for jaxbind's own tests and benchmarks (not part of the API), compiled
 * by tests/_kernels.py for the tests only (not installed with the package).
 * They are written against the public header only, as a user's kernels are.
 */
#include <complex.h>
#include <math.h>
#include <pthread.h>
#include <string.h>

#include "jaxbind.h"

#define EXPORT __attribute__((visibility("default")))

static int check_counts(const jaxbind_call *call, int64_t n_in, int64_t n_out) {
  if (call->n_in < n_in || call->n_out != n_out) {
    return jaxbind_fail(call, "expected at least %lld inputs and %lld outputs, got %lld and %lld",
                        (long long)n_in, (long long)n_out, (long long)call->n_in,
                        (long long)call->n_out);
  }
  return 0;
}

/* Fails unless each of the first n arrays has the dtype given: kernels that
 * assume a dtype check it, so that a call with another one is an error, not
 * a write past the end of a buffer. */
static int check_dtypes(const jaxbind_call *call, const char *kernel, const jaxbind_array *arrays,
                        int64_t n, int64_t dtype) {
  for (int64_t i = 0; i < n; ++i) {
    if (arrays[i].dtype != dtype) {
      return jaxbind_fail(call, "%s: array %lld has dtype code %lld, expected %lld", kernel,
                          (long long)i, (long long)arrays[i].dtype, (long long)dtype);
    }
  }
  return 0;
}

/* out[0] = factor * in[last], factor = kwarg "factor" (default 2); real and
 * complex floats. Linear in its last input, so it is its own transpose. */
EXPORT int jb_scale(const jaxbind_call *call) {
  if (check_counts(call, 1, 1)) return 1;
  const jaxbind_array *x = &call->in[call->n_in - 1];
  jaxbind_array *y = &call->out[0];
  const double factor = jaxbind_kwarg_float(call, "factor", 2.0);
  const int64_t n = jaxbind_size(x);
  if (x->dtype != y->dtype) return jaxbind_fail(call, "input and output dtypes differ");
  switch (x->dtype) {
    case JAXBIND_FLOAT32: {
      const float *a = x->data; float *b = y->data;
      for (int64_t i = 0; i < n; ++i) b[i] = (float)factor * a[i];
      return 0;
    }
    case JAXBIND_FLOAT64: {
      const double *a = x->data; double *b = y->data;
      for (int64_t i = 0; i < n; ++i) b[i] = factor * a[i];
      return 0;
    }
    case JAXBIND_COMPLEX64: {
      const float complex *a = x->data; float complex *b = y->data;
      for (int64_t i = 0; i < n; ++i) b[i] = (float)factor * a[i];
      return 0;
    }
    case JAXBIND_COMPLEX128: {
      const double complex *a = x->data; double complex *b = y->data;
      for (int64_t i = 0; i < n; ++i) b[i] = factor * a[i];
      return 0;
    }
    default:
      return jaxbind_fail(call, "jb_scale: unsupported dtype code %lld", (long long)x->dtype);
  }
}

/* out[0] = in[0] * in[1] elementwise (real and complex floats, both of out[0]'s dtype).
 * Bilinear; each transpose is the same product (the other factor times the cotangent). */
EXPORT int jb_multiply(const jaxbind_call *call) {
  if (check_counts(call, 2, 1)) return 1;
  const jaxbind_array *a = &call->in[0], *b = &call->in[1];
  jaxbind_array *y = &call->out[0];
  if (check_dtypes(call, "jb_multiply", call->in, 2, y->dtype)) return 1;
  const int64_t n = jaxbind_size(y);
  if (jaxbind_size(a) != n || jaxbind_size(b) != n) return jaxbind_fail(call, "jb_multiply: sizes differ");
  switch (y->dtype) {
#define JB_MULTIPLY(CODE, T) \
    case CODE: { \
      const T *p = a->data, *q = b->data; T *r = y->data; \
      for (int64_t i = 0; i < n; ++i) r[i] = p[i] * q[i]; \
      return 0; \
    }
    JB_MULTIPLY(JAXBIND_FLOAT32, float)
    JB_MULTIPLY(JAXBIND_FLOAT64, double)
    JB_MULTIPLY(JAXBIND_COMPLEX64, float complex)
    JB_MULTIPLY(JAXBIND_COMPLEX128, double complex)
#undef JB_MULTIPLY
    default:
      return jaxbind_fail(call, "jb_multiply: unsupported dtype code %lld", (long long)y->dtype);
  }
}

/* out[0] = in[0] (byte copy) for every dtype; out[1] = the dtype code as int64. */
EXPORT int jb_copy_any(const jaxbind_call *call) {
  if (check_counts(call, 1, 2)) return 1;
  const jaxbind_array *x = &call->in[0];
  if (call->out[0].dtype != x->dtype) return jaxbind_fail(call, "dtype mismatch");
  int64_t width = 0;
  switch (x->dtype) {
    case JAXBIND_BOOL: case JAXBIND_INT8: case JAXBIND_UINT8:
    case JAXBIND_FLOAT8_E5M2: case JAXBIND_FLOAT8_E4M3FN: case JAXBIND_FLOAT8_E4M3B11FNUZ:
    case JAXBIND_FLOAT8_E5M2FNUZ: case JAXBIND_FLOAT8_E4M3FNUZ: case JAXBIND_FLOAT8_E4M3:
    case JAXBIND_FLOAT8_E3M4: width = 1; break;
    case JAXBIND_INT16: case JAXBIND_UINT16: case JAXBIND_FLOAT16: case JAXBIND_BFLOAT16: width = 2; break;
    case JAXBIND_INT32: case JAXBIND_UINT32: case JAXBIND_FLOAT32: width = 4; break;
    case JAXBIND_INT64: case JAXBIND_UINT64: case JAXBIND_FLOAT64: case JAXBIND_COMPLEX64: width = 8; break;
    case JAXBIND_COMPLEX128: width = 16; break;
    default: return jaxbind_fail(call, "unknown dtype code %lld", (long long)x->dtype);
  }
  memcpy(call->out[0].data, x->data, (size_t)(width * jaxbind_size(x)));
  *(int64_t *)call->out[1].data = x->dtype;
  return 0;
}

/* A nonlinear elementwise function and its derivatives, float64:
 * f(x) = sin(x) * x; f'(x) = cos(x) * x + sin(x). Inputs: (x) for f,
 * (x, t) for the jvp, (x, ct) for the vjp. */
static double f_prime(double x) { return cos(x) * x + sin(x); }

EXPORT int jb_xsin(const jaxbind_call *call) {
  if (check_counts(call, 1, 1)) return 1;
  if (call->in[0].dtype != JAXBIND_FLOAT64) return jaxbind_fail(call, "jb_xsin: float64 only");
  if (check_dtypes(call, "jb_xsin", call->out, 1, JAXBIND_FLOAT64)) return 1;
  const double *x = call->in[0].data; double *y = call->out[0].data;
  for (int64_t i = 0, n = jaxbind_size(&call->in[0]); i < n; ++i) y[i] = sin(x[i]) * x[i];
  return 0;
}

EXPORT int jb_xsin_derivative(const jaxbind_call *call) { /* jvp and vjp alike */
  if (check_counts(call, 2, 1)) return 1;
  if (check_dtypes(call, "jb_xsin_derivative", call->in, 2, JAXBIND_FLOAT64) ||
      check_dtypes(call, "jb_xsin_derivative", call->out, 1, JAXBIND_FLOAT64)) return 1;
  const double *x = call->in[0].data, *t = call->in[1].data; double *y = call->out[0].data;
  for (int64_t i = 0, n = jaxbind_size(&call->in[0]); i < n; ++i) y[i] = f_prime(x[i]) * t[i];
  return 0;
}

/* Two outputs of different shapes from one input (float64):
 * out[0] = 3 x, out[1] = sum(x) (a scalar). Linear. */
EXPORT int jb_triple_and_sum(const jaxbind_call *call) {
  if (check_counts(call, 1, 2)) return 1;
  if (check_dtypes(call, "jb_triple_and_sum", call->in, 1, JAXBIND_FLOAT64) ||
      check_dtypes(call, "jb_triple_and_sum", call->out, 2, JAXBIND_FLOAT64)) return 1;
  if (jaxbind_size(&call->out[1]) != 1) return jaxbind_fail(call, "jb_triple_and_sum: out[1] must be a scalar");
  const double *x = call->in[0].data;
  double *y = call->out[0].data, *s = call->out[1].data, total = 0.0;
  for (int64_t i = 0, n = jaxbind_size(&call->in[0]); i < n; ++i) {
    y[i] = 3.0 * x[i];
    total += x[i];
  }
  *s = total;
  return 0;
}

/* The transpose: in = (ct_y, ct_s); out[0] = 3 ct_y + ct_s. */
EXPORT int jb_triple_and_sum_T(const jaxbind_call *call) {
  if (check_counts(call, 2, 1)) return 1;
  if (check_dtypes(call, "jb_triple_and_sum_T", call->in, 2, JAXBIND_FLOAT64) ||
      check_dtypes(call, "jb_triple_and_sum_T", call->out, 1, JAXBIND_FLOAT64)) return 1;
  if (jaxbind_size(&call->in[1]) != 1) return jaxbind_fail(call, "jb_triple_and_sum_T: in[1] must be a scalar");
  const double *cy = call->in[0].data, *cs = call->in[1].data; double *x = call->out[0].data;
  for (int64_t i = 0, n = jaxbind_size(&call->out[0]); i < n; ++i) x[i] = 3.0 * cy[i] + *cs;
  return 0;
}

/* Fails with a message that carries a kwarg. */
EXPORT int jb_fail(const jaxbind_call *call) {
  return jaxbind_fail(call, "kernel failed on purpose (code=%lld)",
                      (long long)jaxbind_kwarg_int(call, "code", -1));
}

/* Fails without a message. */
EXPORT int jb_fail_silently(const jaxbind_call *call) { (void)call; return 7; }

/* Fails with a message that is not UTF-8: Latin-1 bytes, a stray continuation byte, and a
 * two-byte character cut after its first byte at the end. */
EXPORT int jb_fail_latin1(const jaxbind_call *call) {
  return jaxbind_fail(call, "d\xe9" "faut \x80 de convergence \xc3");
}

/* y = x (float64) for elements whose first entry is >= 0, each leaving a note in the error buffer
 * though it succeeds; an element whose first entry is negative fails without a message. */
EXPORT int jb_note_then_fail_silently(const jaxbind_call *call) {
  if (check_counts(call, 1, 1) || check_dtypes(call, "jb_note_then_fail_silently", call->in, 1, JAXBIND_FLOAT64) ||
      check_dtypes(call, "jb_note_then_fail_silently", call->out, 1, JAXBIND_FLOAT64)) return 1;
  const double *x = call->in[0].data;
  double *y = call->out[0].data;
  const int64_t n = jaxbind_size(&call->in[0]);
  if (n > 0 && x[0] < 0) return 5;
  if (call->error != NULL && call->error_size > 16) snprintf(call->error, (size_t)call->error_size, "a stale note");
  for (int64_t i = 0; i < n; ++i) y[i] = x[i];
  return 0;
}

/* Reports its kwargs into a float64 output of 8 entries:
 * [int i, float f, bool b, strlen(s), s[0], sum(ints), sum(floats), n_kwargs]. */
EXPORT int jb_kwargs_probe(const jaxbind_call *call) {
  if (check_counts(call, 0, 1)) return 1;
  if (check_dtypes(call, "jb_kwargs_probe", call->out, 1, JAXBIND_FLOAT64)) return 1;
  if (jaxbind_size(&call->out[0]) < 8) return jaxbind_fail(call, "jb_kwargs_probe: out[0] needs 8 entries");
  double *o = call->out[0].data;
  const jaxbind_kwarg *s = jaxbind_find_kwarg(call, "s");
  const jaxbind_kwarg *ints = jaxbind_find_kwarg(call, "ints");
  const jaxbind_kwarg *floats = jaxbind_find_kwarg(call, "floats");
  const jaxbind_kwarg *b = jaxbind_find_kwarg(call, "b");
  if (!s || s->type != JAXBIND_KW_STRING || !ints || ints->type != JAXBIND_KW_INT_ARRAY ||
      !floats || floats->type != JAXBIND_KW_FLOAT_ARRAY || !b || b->type != JAXBIND_KW_BOOL) {
    return jaxbind_fail(call, "kwargs of unexpected types");
  }
  o[0] = (double)jaxbind_kwarg_int(call, "i", -1);
  o[1] = jaxbind_kwarg_float(call, "f", -1.0);
  o[2] = (double)b->int_value;
  o[3] = (double)s->size;
  o[4] = (double)(unsigned char)s->string_value[0];
  o[5] = 0.0;
  for (int64_t k = 0; k < ints->size; ++k) o[5] += (double)ints->int_array[k];
  o[6] = 0.0;
  for (int64_t k = 0; k < floats->size; ++k) o[6] += floats->float_array[k];
  o[7] = (double)call->n_kwargs;
  return 0;
}

/* func_can_batch: y = factor * x elementwise (float64), and the batch layout
 * checked against the shapes: every batch axis must be a valid axis. With a
 * second output (int64), writes batch_levels into every entry of it, -1 when the
 * kwargs are missing; with one output it is its own transpose. */
EXPORT int jb_batched_scale(const jaxbind_call *call) {
  if (call->n_out != 1 && check_counts(call, 1, 2)) return 1;
  if (call->n_in < 1) return jaxbind_fail(call, "jb_batched_scale: no input");
  if (check_dtypes(call, "jb_batched_scale", call->in, call->n_in, JAXBIND_FLOAT64) ||
      check_dtypes(call, "jb_batched_scale", call->out, 1, JAXBIND_FLOAT64) ||
      check_dtypes(call, "jb_batched_scale", call->out + 1, call->n_out - 1, JAXBIND_INT64)) return 1;

  const jaxbind_kwarg *levels = jaxbind_find_kwarg(call, "batch_levels");
  const jaxbind_kwarg *axes = jaxbind_find_kwarg(call, "batch_axes");
  int64_t nlev = -1;
  if (levels && axes) {
    nlev = levels->int_value;
    if (axes->size != call->n_in * nlev) return jaxbind_fail(call, "batch_axes has %lld entries", (long long)axes->size);
    for (int64_t k = 0; k < axes->size; ++k) {
      int64_t a = axes->int_array[k];
      if (a < -1 || a >= call->in[k / (nlev ? nlev : 1)].rank) return jaxbind_fail(call, "bad batch axis %lld", (long long)a);
    }
  }
  const double factor = jaxbind_kwarg_float(call, "factor", 2.0);
  const double *x = call->in[call->n_in - 1].data; double *y = call->out[0].data;
  for (int64_t i = 0, n = jaxbind_size(&call->in[call->n_in - 1]); i < n; ++i) y[i] = factor * x[i];
  if (call->n_out == 1) return 0;
  int64_t *levels_out = call->out[1].data;  /* batched too under vmap: every entry */
  for (int64_t i = 0, n = jaxbind_size(&call->out[1]); i < n; ++i) levels_out[i] = nlev;
  return 0;
}

/* About a millisecond of work per call by default (kwarg "iterations"):
 * out[0] = in[0] + sum_k sin(k) / iterations, so its result is checkable. */
EXPORT int jb_busy(const jaxbind_call *call) {
  if (check_counts(call, 1, 1)) return 1;
  if (check_dtypes(call, "jb_busy", call->in, 1, JAXBIND_FLOAT64) ||
      check_dtypes(call, "jb_busy", call->out, 1, JAXBIND_FLOAT64)) return 1;
  const int64_t iterations = jaxbind_kwarg_int(call, "iterations", 200000);
  double acc = 0.0;
  for (int64_t k = 0; k < iterations; ++k) acc += sin((double)k);
  const double *x = call->in[0].data; double *y = call->out[0].data;
  for (int64_t i = 0, n = jaxbind_size(&call->in[0]); i < n; ++i) y[i] = x[i] + acc / (double)iterations;
  return 0;
}

/* out[0] = in[0] * 2 for float64; the cheapest useful kernel (benchmarks). */
EXPORT int jb_double(const jaxbind_call *call) {
  if (call->n_in < 1 || call->n_out < 1 || call->in[0].dtype != JAXBIND_FLOAT64 ||
      call->out[0].dtype != JAXBIND_FLOAT64) {
    return jaxbind_fail(call, "jb_double: one float64 input and output");
  }
  const double *x = call->in[0].data; double *y = call->out[0].data;
  for (int64_t i = 0, n = jaxbind_size(&call->in[0]); i < n; ++i) y[i] = 2.0 * x[i];
  return 0;
}

/* Does nothing (benchmarks: the pure overhead). */
EXPORT int jb_empty(const jaxbind_call *call) { (void)call; return 0; }

/* Calls of jb_busy_thread since the last jb_busy_thread_calls(1) (atomic: the walk runs
 * elements on several threads at once). */
static int64_t busy_thread_calls = 0;

/* The number of jb_busy_thread calls so far; reset to 0 afterwards when `reset` is nonzero. */
EXPORT int64_t jb_busy_thread_calls(int reset) {
  return reset ? __atomic_exchange_n(&busy_thread_calls, 0, __ATOMIC_SEQ_CST)
               : __atomic_load_n(&busy_thread_calls, __ATOMIC_SEQ_CST);
}

/* The parallel walk (tests): about `iterations` (kwarg, default 20000) of busy work, then
 * out[0] = in[0] (float64) and out[1] = an id of the thread that ran it (int64 scalar).
 * Fails, naming the value, when in[0][0] < kwarg "fail_below" (default: never). An element
 * whose in[0][0] is negative is multiplied by kwarg "negative_scale" (a float, default 1),
 * which only such elements read. Every call is counted (jb_busy_thread_calls). */
EXPORT int jb_busy_thread(const jaxbind_call *call) {
  __atomic_fetch_add(&busy_thread_calls, 1, __ATOMIC_SEQ_CST);
  if (check_counts(call, 1, 2)) return 1;
  if (call->in[0].dtype != JAXBIND_FLOAT64 || call->out[0].dtype != JAXBIND_FLOAT64 ||
      call->out[1].dtype != JAXBIND_INT64 || call->out[1].rank != 0)
    return jaxbind_fail(call, "jb_busy_thread: float64 in, (float64, int64 scalar) out");
  const int64_t iterations = jaxbind_kwarg_int(call, "iterations", 20000);
  const double fail_below = jaxbind_kwarg_float(call, "fail_below", -HUGE_VAL);
  volatile double acc = 0.0;
  for (int64_t k = 0; k < iterations; ++k) acc += sin((double)k);
  const double *x = call->in[0].data; double *y = call->out[0].data;
  const int64_t n = jaxbind_size(&call->in[0]);
  if (n > 0 && x[0] < fail_below) return jaxbind_fail(call, "element %g is below %g", x[0], fail_below);
  const double scale = n > 0 && x[0] < 0 ? jaxbind_kwarg_float(call, "negative_scale", 1.0) : 1.0;
  for (int64_t i = 0; i < n; ++i) y[i] = scale * x[i];
  *(int64_t *)call->out[1].data = (int64_t)(uintptr_t)pthread_self();
  return 0;
}

/* Writes the first half of out[0] (float64, ones) and leaves the rest: the
 * checking mode for unwritten outputs must report it. */
EXPORT int jb_write_half(const jaxbind_call *call) {
  if (check_counts(call, 0, 1)) return 1;
  if (check_dtypes(call, "jb_write_half", call->out, 1, JAXBIND_FLOAT64)) return 1;
  double *y = call->out[0].data;
  for (int64_t i = 0, n = jaxbind_size(&call->out[0]); i < n / 2; ++i) y[i] = 1.0;
  return 0;
}

/* out[0] = factor * in[last] (float64; factor = kwarg "factor", default 2), like
 * jb_scale, but with a domain: an input of zeros only is refused. Linear in its
 * last input, so it is its own transpose. (Padding of a partitioned batch, which
 * XLA fills with zeros, must never reach it.) */
EXPORT int jb_scale_nonzero(const jaxbind_call *call) {
  if (check_counts(call, 1, 1)) return 1;
  const jaxbind_array *x = &call->in[call->n_in - 1];
  if (check_dtypes(call, "jb_scale_nonzero", x, 1, JAXBIND_FLOAT64) ||
      check_dtypes(call, "jb_scale_nonzero", call->out, 1, JAXBIND_FLOAT64)) return 1;
  const double factor = jaxbind_kwarg_float(call, "factor", 2.0);
  const double *a = x->data; double *b = call->out[0].data;
  const int64_t n = jaxbind_size(x);
  int64_t nonzero = 0;
  for (int64_t i = 0; i < n; ++i) nonzero += a[i] != 0.0;
  if (n > 0 && nonzero == 0) return jaxbind_fail(call, "jb_scale_nonzero: an input of zeros only");
  for (int64_t i = 0; i < n; ++i) b[i] = factor * a[i];
  return 0;
}

/* Any number of float64 inputs and outputs of one size: out[j] = sum of every input + j
 * (tests: calls with more buffers than the handler describes on its stack). */
EXPORT int jb_sum_inputs(const jaxbind_call *call) {
  if (call->n_in < 1 || call->n_out < 1) return jaxbind_fail(call, "jb_sum_inputs: no inputs or outputs");
  const int64_t n = jaxbind_size(&call->in[0]);
  for (int64_t j = 0; j < call->n_out; ++j) {
    if (call->out[j].dtype != JAXBIND_FLOAT64 || jaxbind_size(&call->out[j]) != n) {
      return jaxbind_fail(call, "jb_sum_inputs: output %lld is not float64 of the inputs' size", (long long)j);
    }
    double *y = call->out[j].data;
    for (int64_t e = 0; e < n; ++e) y[e] = (double)j;
    for (int64_t i = 0; i < call->n_in; ++i) {
      if (call->in[i].dtype != JAXBIND_FLOAT64 || jaxbind_size(&call->in[i]) != n) {
        return jaxbind_fail(call, "jb_sum_inputs: input %lld is not float64 of one size", (long long)i);
      }
      const double *x = call->in[i].data;
      for (int64_t e = 0; e < n; ++e) y[e] += x[e];
    }
  }
  return 0;
}

/* Reads kwarg "v" with the accessor chosen by kwarg "how" (read with jaxbind_kwarg_int:
 * 0 int, 1 float, 2 bool, 3 string, 4 int array, 5 float array) and reports, into a
 * float64 output of 3 entries, [what it read, its size, 1 if it got the fallback]: a
 * number as it is, a string's first byte and its length, an array's sum and its length.
 * The fallbacks are -7, -2.5, 2 (a bool accessor returns its fallback as it is) and
 * "fallback"; arrays have none (NULL). It returns 0 whatever it read: a kwarg it could
 * not read fails the call all the same. */
EXPORT int jb_kwarg_read(const jaxbind_call *call) {
  if (check_counts(call, 0, 1) || check_dtypes(call, "jb_kwarg_read", call->out, 1, JAXBIND_FLOAT64)) return 1;
  if (jaxbind_size(&call->out[0]) != 3) return jaxbind_fail(call, "jb_kwarg_read: out[0] needs 3 entries");
  double *o = call->out[0].data;
  const int64_t how = jaxbind_kwarg_int(call, "how", 0);
  int64_t size = 1;
  switch (how) {
    case 0: o[0] = (double)jaxbind_kwarg_int(call, "v", -7); o[2] = o[0] == -7; break;
    case 1: o[0] = jaxbind_kwarg_float(call, "v", -2.5); o[2] = o[0] == -2.5; break;
    case 2: o[0] = jaxbind_kwarg_bool(call, "v", 2); o[2] = o[0] == 2; break;
    case 3: {
      static const char fallback[] = "fallback";
      const char *s = jaxbind_kwarg_string(call, "v", fallback);
      o[0] = (double)(unsigned char)s[0];
      size = (int64_t)strlen(s);
      o[2] = s == fallback;
      break;
    }
    case 4: {
      const int64_t *a = jaxbind_kwarg_int_array(call, "v", &size);
      o[0] = 0.0;
      for (int64_t k = 0; k < size; ++k) o[0] += (double)a[k];
      o[2] = a == NULL && size == 0 && jaxbind_find_kwarg(call, "v") == NULL;
      break;
    }
    case 5: {
      const double *a = jaxbind_kwarg_float_array(call, "v", &size);
      o[0] = 0.0;
      for (int64_t k = 0; k < size; ++k) o[0] += a[k];
      o[2] = a == NULL && size == 0 && jaxbind_find_kwarg(call, "v") == NULL;
      break;
    }
    default: return jaxbind_fail(call, "jb_kwarg_read: how=%lld", (long long)how);
  }
  o[1] = (double)size;
  return 0;
}

/* y = r * x (float64), r = kwarg "r" (a float, default 0.25); after a kwarg it could not
 * read, it fails with a message of its own, which the kwarg's message takes precedence over. */
EXPORT int jb_radius(const jaxbind_call *call) {
  if (check_counts(call, 1, 1) || check_dtypes(call, "jb_radius", call->in, 1, JAXBIND_FLOAT64) ||
      check_dtypes(call, "jb_radius", call->out, 1, JAXBIND_FLOAT64)) return 1;
  const double r = jaxbind_kwarg_float(call, "r", 0.25);
  if (jaxbind_kwarg_int(call, "fail", 0)) return jaxbind_fail(call, "jb_radius: failed on purpose");
  const double *x = call->in[0].data; double *y = call->out[0].data;
  for (int64_t i = 0, n = jaxbind_size(&call->in[0]); i < n; ++i) y[i] = r * x[i];
  return 0;
}
