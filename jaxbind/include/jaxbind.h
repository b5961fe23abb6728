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
 * Kwargs: read them with the jaxbind_kwarg_* accessors below. A kwarg the call
 * passed with a type the accessor cannot read as asked (a string read as a
 * float, a float read as an int, an array read as a number) is not replaced by
 * the fallback: the accessor writes why into call->kwarg_error, and the call
 * fails with that message (naming the kwarg, the type passed and the type
 * asked for) whatever the kernel returns. The kernel needs no check of its
 * own: it goes on with the fallback, and its outputs are thrown away. The
 * conversions an accessor makes are listed at each one. To have a misspelt or
 * mistyped kwarg refused when the op is called, before anything runs, declare
 * the kwargs a kernel takes: jaxbind.native(kernel, kwargs={"r": float}).
 *
 * Stability: this is ABI version 2. Each version only appends fields to
 * jaxbind_call (call->struct_size tells how many the caller filled:
 * JAXBIND_CALL_HAS) and adds dtype and kwarg codes and helpers; existing
 * fields, codes and meanings never change, so a kernel compiled against an
 * older header keeps working (with that header's helpers: version 1's kwarg
 * accessors return the fallback for a kwarg of another type). Check a version
 * with >=, never ==. Version 2 appended kwarg_error and kwarg_error_size.
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

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdarg.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

#define JAXBIND_ABI_VERSION 2

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
  /* Version 2: read only when JAXBIND_CALL_HAS(call, kwarg_error_size). */
  char *kwarg_error;           /* why a kwarg accessor could not read a kwarg as asked... */
  int64_t kwarg_error_size;    /* ...in this many bytes; a message there fails the call */
} jaxbind_call;

/* Whether the caller filled `field` of the call (a field of a later version
 * than the caller's is absent). */
#define JAXBIND_CALL_HAS(call, field) \
  ((call)->struct_size >= (int64_t)(offsetof(jaxbind_call, field) + sizeof(int64_t)))

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

/* The accessors' failure path is a function of its own, kept out of their
 * inlined code (static, not inline: a compiler warns of noinline on inline). */
#if defined(__GNUC__) || defined(__clang__)
#define JAXBIND_COLD_ __attribute__((cold, noinline, unused))
#else
#define JAXBIND_COLD_
#endif

/* How a kwarg's type reads in a message, with an article. */
static inline const char *jaxbind_kwarg_type_name_(int64_t type) {
  switch (type) {
    case JAXBIND_KW_INT: return "an int";
    case JAXBIND_KW_FLOAT: return "a float";
    case JAXBIND_KW_BOOL: return "a bool";
    case JAXBIND_KW_STRING: return "a string";
    case JAXBIND_KW_INT_ARRAY: return "an int array";
    case JAXBIND_KW_FLOAT_ARRAY: return "a float array";
    default: return "a kwarg of an unknown type";
  }
}

/* The accessors' failure: records why `kw` cannot be read as `asked` by
 * `accessor`, which takes `takes`; the first failure of a call is the one
 * kept. A caller older than version 2 has no kwarg_error: nothing is written
 * (the fallback is returned, as version 1 did). */
static JAXBIND_COLD_ void jaxbind_kwarg_refuse_(const jaxbind_call *call, const jaxbind_kwarg *kw,
                                                const char *accessor, const char *asked,
                                                const char *takes) {
  if (!JAXBIND_CALL_HAS(call, kwarg_error_size) || call->kwarg_error == NULL ||
      call->kwarg_error_size <= 0 || call->kwarg_error[0] != '\0') {
    return;
  }
  char value[64] = "";
  switch (kw->type) {
    case JAXBIND_KW_INT: snprintf(value, sizeof value, " (%lld)", (long long)kw->int_value); break;
    case JAXBIND_KW_FLOAT: snprintf(value, sizeof value, " (%g)", kw->float_value); break;
    case JAXBIND_KW_BOOL: snprintf(value, sizeof value, " (%s)", kw->int_value ? "True" : "False"); break;
    case JAXBIND_KW_STRING:
      snprintf(value, sizeof value, " ('%.40s%s')", kw->string_value ? kw->string_value : "",
               kw->size > 40 ? "..." : "");
      break;
    case JAXBIND_KW_INT_ARRAY: case JAXBIND_KW_FLOAT_ARRAY:
      snprintf(value, sizeof value, " of %lld %s", (long long)kw->size, kw->size == 1 ? "entry" : "entries");
      break;
    default: snprintf(value, sizeof value, " (type code %lld)", (long long)kw->type); break;
  }
  snprintf(call->kwarg_error, (size_t)call->kwarg_error_size,
           "keyword argument '%s' is %s%s, but the kernel reads it as %s (%s): pass %s",
           kw->name, jaxbind_kwarg_type_name_(kw->type), value, asked, accessor, takes);
}

/*
 * The accessors. Each returns the kwarg called `name` read as its type, or
 * `fallback` when the call did not pass it. A kwarg passed with a type it does
 * not read (see each) fails the call (see "Kwargs" above) and returns the
 * fallback. The success path is the lookup and a compare of the type code.
 */

/* An int; a bool reads as 0 or 1. A float is refused, even a whole one. */
static inline int64_t jaxbind_kwarg_int(const jaxbind_call *call, const char *name,
                                        int64_t fallback) {
  const jaxbind_kwarg *kw = jaxbind_find_kwarg(call, name);
  if (kw == NULL) return fallback;
  if (kw->type == JAXBIND_KW_INT || kw->type == JAXBIND_KW_BOOL) return kw->int_value;
  jaxbind_kwarg_refuse_(call, kw, "jaxbind_kwarg_int", "an int", "an int (or a bool)");
  return fallback;
}

/* A float; an int converts (exactly up to 2**53). A bool is refused. */
static inline double jaxbind_kwarg_float(const jaxbind_call *call, const char *name,
                                         double fallback) {
  const jaxbind_kwarg *kw = jaxbind_find_kwarg(call, name);
  if (kw == NULL) return fallback;
  if (kw->type == JAXBIND_KW_FLOAT) return kw->float_value;
  if (kw->type == JAXBIND_KW_INT) return (double)kw->int_value;
  jaxbind_kwarg_refuse_(call, kw, "jaxbind_kwarg_float", "a float", "a float (or an int)");
  return fallback;
}

/* A bool as 0 or 1; the ints 0 and 1 read as bools, other ints are refused. */
static inline int jaxbind_kwarg_bool(const jaxbind_call *call, const char *name, int fallback) {
  const jaxbind_kwarg *kw = jaxbind_find_kwarg(call, name);
  if (kw == NULL) return fallback;
  if (kw->type == JAXBIND_KW_BOOL || (kw->type == JAXBIND_KW_INT && (kw->int_value == 0 || kw->int_value == 1))) {
    return kw->int_value != 0;
  }
  jaxbind_kwarg_refuse_(call, kw, "jaxbind_kwarg_bool", "a bool", "a bool (or the int 0 or 1)");
  return fallback;
}

/* A string (NUL-terminated UTF-8, valid while the kernel runs). */
static inline const char *jaxbind_kwarg_string(const jaxbind_call *call, const char *name,
                                               const char *fallback) {
  const jaxbind_kwarg *kw = jaxbind_find_kwarg(call, name);
  if (kw == NULL) return fallback;
  if (kw->type == JAXBIND_KW_STRING) return kw->string_value;
  jaxbind_kwarg_refuse_(call, kw, "jaxbind_kwarg_string", "a string", "a string");
  return fallback;
}

/* An int array: its entries, their number in *size (NULL and 0 when absent or
 * refused). An empty float array reads as an empty int array. */
static inline const int64_t *jaxbind_kwarg_int_array(const jaxbind_call *call, const char *name,
                                                     int64_t *size) {
  const jaxbind_kwarg *kw = jaxbind_find_kwarg(call, name);
  *size = 0;
  if (kw == NULL) return NULL;
  if (kw->type == JAXBIND_KW_INT_ARRAY || (kw->type == JAXBIND_KW_FLOAT_ARRAY && kw->size == 0)) {
    *size = kw->size;
    return kw->int_array;
  }
  jaxbind_kwarg_refuse_(call, kw, "jaxbind_kwarg_int_array", "an int array",
                        "a 1-d sequence or array of ints");
  return NULL;
}

/* A float array: its entries, their number in *size (NULL and 0 when absent or
 * refused). An int array is refused (there is no float copy of it to point
 * to; [1, 2] is an int array: write [1.0, 2.0], or declare the kwarg
 * list[float] and jaxbind converts it); an empty int array reads as empty. */
static inline const double *jaxbind_kwarg_float_array(const jaxbind_call *call, const char *name,
                                                      int64_t *size) {
  const jaxbind_kwarg *kw = jaxbind_find_kwarg(call, name);
  *size = 0;
  if (kw == NULL) return NULL;
  if (kw->type == JAXBIND_KW_FLOAT_ARRAY || (kw->type == JAXBIND_KW_INT_ARRAY && kw->size == 0)) {
    *size = kw->size;
    return kw->float_array;
  }
  jaxbind_kwarg_refuse_(call, kw, "jaxbind_kwarg_float_array", "a float array",
                        "a 1-d sequence or array of floats ([1.0, 2.0], not [1, 2])");
  return NULL;
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
