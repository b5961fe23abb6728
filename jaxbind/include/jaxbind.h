/*
 * jaxbind.h -- the calling convention of jaxbind native kernels.
 *
 * A native kernel is a C function that jaxbind calls straight from XLA, with
 * no Python and no GIL on the call path:
 *
 *     #include <jaxbind.h>
 *     int my_kernel(const jaxbind_call *call);
 *
 * It reads its inputs from call->in, writes every output into call->out and
 * returns 0. On failure it writes a message (jaxbind_fail does both) and
 * returns non-zero; the message reaches Python as an exception naming the op.
 *
 * Bind it from Python wherever jaxbind takes a callback (f, a transpose,
 * f_jvp, f_vjp), as a ctypes function (a function of a ctypes.CDLL, or a
 * ctypes.CFUNCTYPE object), a numba.cfunc, a PyCapsule holding the function
 * pointer, or jaxbind.native(address). jaxbind.get_include() returns the
 * folder of this header.
 *
 * Rules:
 *   - Arrays are dense and row-major (C order). Inputs are read-only.
 *   - Do not keep pointers to the arrays after returning: XLA reuses them.
 *   - Kernels may run concurrently on several threads: be reentrant.
 *   - Scalars (rank 0) have shape == NULL or a pointer to nothing; size 1.
 *
 * Stability: this is ABI version 1. Later versions only append fields to
 * jaxbind_call (call->struct_size tells how many the caller filled) and add
 * new dtype and kwarg codes; existing fields, codes and meanings never change,
 * so a kernel compiled against this header keeps working.
 *
 * Fortran: jaxbind.f90 in this folder is this header's twin (module jaxbind:
 * the structs as BIND(C) types, the codes and the helpers, under the same
 * names). The structs' fields are int64_t, pointers and, in jaxbind_kwarg, one
 * double (float_value), all 8 bytes on the 64-bit platforms jaxbind runs on,
 * so there is no padding: INTEGER(C_INT64_T), TYPE(C_PTR) and REAL(C_DOUBLE)
 * components in the order written match them.
 */
#ifndef JAXBIND_H_
#define JAXBIND_H_

#include <stdint.h>
#include <stdio.h>
#include <stdarg.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

#define JAXBIND_ABI_VERSION 1

/* Element types (the numbers are XLA's element type codes). */
enum jaxbind_dtype {
  JAXBIND_BOOL = 1,       /* 1 byte, 0 or 1 */
  JAXBIND_INT8 = 2,
  JAXBIND_INT16 = 3,
  JAXBIND_INT32 = 4,
  JAXBIND_INT64 = 5,
  JAXBIND_UINT8 = 6,
  JAXBIND_UINT16 = 7,
  JAXBIND_UINT32 = 8,
  JAXBIND_UINT64 = 9,
  JAXBIND_FLOAT16 = 10,   /* IEEE half */
  JAXBIND_FLOAT32 = 11,
  JAXBIND_FLOAT64 = 12,
  JAXBIND_COMPLEX64 = 15, /* two float32: real, imaginary */
  JAXBIND_BFLOAT16 = 16,  /* the upper 16 bits of a float32 */
  JAXBIND_COMPLEX128 = 18,
  JAXBIND_FLOAT8_E5M2 = 19,
  JAXBIND_FLOAT8_E4M3FN = 20,
  JAXBIND_FLOAT8_E4M3B11FNUZ = 23,
  JAXBIND_FLOAT8_E5M2FNUZ = 24,
  JAXBIND_FLOAT8_E4M3FNUZ = 25,
  JAXBIND_FLOAT8_E4M3 = 28,
  JAXBIND_FLOAT8_E3M4 = 29
};

/* One array: an input or an output. */
typedef struct jaxbind_array {
  void *data;            /* first element; dense, row-major */
  const int64_t *shape;  /* rank entries */
  int64_t rank;
  int64_t dtype;         /* an enum jaxbind_dtype */
} jaxbind_array;

/* Kinds of keyword argument. */
enum jaxbind_kwarg_type {
  JAXBIND_KW_INT = 1,          /* int_value (a Python int or NumPy integer) */
  JAXBIND_KW_FLOAT = 2,        /* float_value (a Python float or NumPy floating) */
  JAXBIND_KW_BOOL = 3,         /* int_value, 0 or 1 */
  JAXBIND_KW_STRING = 4,       /* string_value, NUL-terminated UTF-8; size = bytes without the NUL */
  JAXBIND_KW_INT_ARRAY = 5,    /* int_array, size entries (a 1-d sequence or array of integers) */
  JAXBIND_KW_FLOAT_ARRAY = 6   /* float_array, size entries (a 1-d sequence or array of floats) */
};

/* One keyword argument of the op call. Fields that do not apply are 0/NULL. */
typedef struct jaxbind_kwarg {
  const char *name;            /* NUL-terminated */
  int64_t type;                /* an enum jaxbind_kwarg_type */
  int64_t size;                /* elements (arrays), bytes (strings), 1 (scalars) */
  int64_t int_value;
  double float_value;
  const char *string_value;
  const int64_t *int_array;
  const double *float_array;
} jaxbind_kwarg;

/* Everything one kernel call gets. */
typedef struct jaxbind_call {
  int64_t struct_size;         /* sizeof(jaxbind_call) as the caller knows it */
  int64_t abi_version;         /* JAXBIND_ABI_VERSION of the caller */
  int64_t n_out;
  jaxbind_array *out;          /* n_out outputs, to be written */
  int64_t n_in;
  const jaxbind_array *in;     /* n_in inputs, read-only */
  int64_t n_kwargs;
  const jaxbind_kwarg *kwargs; /* the op call's keyword arguments */
  char *error;                 /* room for an error message... */
  int64_t error_size;          /* ...of this many bytes, NUL included */
} jaxbind_call;

/*
 * With func_can_batch=True a kernel sees the whole batch and two more kwargs:
 *   "batch_levels"  INT        L, the number of vmap levels (0 when not batched)
 *   "batch_axes"    INT_ARRAY  n_in * L entries: entry [i * L + l] is the axis
 *                              of input i that vmap level l maps (oldest level
 *                              first), or -1 for an input no level maps.
 * (An input is mapped at every level or at none.)
 */

typedef int (*jaxbind_kernel)(const jaxbind_call *call);

/* The kwarg called `name`, or NULL. */
static inline const jaxbind_kwarg *jaxbind_find_kwarg(const jaxbind_call *call,
                                                      const char *name) {
  for (int64_t i = 0; i < call->n_kwargs; ++i) {
    if (strcmp(call->kwargs[i].name, name) == 0) return &call->kwargs[i];
  }
  return NULL;
}

/* Integer and float kwargs with a default when absent (ints convert to floats). */
static inline int64_t jaxbind_kwarg_int(const jaxbind_call *call, const char *name,
                                        int64_t fallback) {
  const jaxbind_kwarg *kw = jaxbind_find_kwarg(call, name);
  if (kw && (kw->type == JAXBIND_KW_INT || kw->type == JAXBIND_KW_BOOL)) return kw->int_value;
  return fallback;
}

static inline double jaxbind_kwarg_float(const jaxbind_call *call, const char *name,
                                         double fallback) {
  const jaxbind_kwarg *kw = jaxbind_find_kwarg(call, name);
  if (kw && kw->type == JAXBIND_KW_FLOAT) return kw->float_value;
  if (kw && kw->type == JAXBIND_KW_INT) return (double)kw->int_value;
  return fallback;
}

/* Number of elements of an array. */
static inline int64_t jaxbind_size(const jaxbind_array *a) {
  int64_t n = 1;
  for (int64_t d = 0; d < a->rank; ++d) n *= a->shape[d];
  return n;
}

/* Write a printf-style error message and return 1: `return jaxbind_fail(call, ...)`. */
static inline int jaxbind_fail(const jaxbind_call *call, const char *format, ...) {
  if (call->error != NULL && call->error_size > 0) {
    va_list args;
    va_start(args, format);
    vsnprintf(call->error, (size_t)call->error_size, format, args);
    va_end(args);
  }
  return 1;
}

#ifdef __cplusplus
}
#endif

#endif /* JAXBIND_H_ */
