#include <jaxbind.h>   /* cc -O2 -shared -fPIC -I$(python -c "import jaxbind; print(jaxbind.get_include())") */

int scale(const jaxbind_call *call) {          /* y = factor * x */
  const double factor = jaxbind_kwarg_float(call, "factor", 2.0);
  if (call->in[0].dtype != JAXBIND_FLOAT64) return jaxbind_fail(call, "float64 only");
  const double *x = call->in[0].data;
  double *y = call->out[0].data;
  for (int64_t i = 0; i < jaxbind_size(&call->in[0]); ++i) y[i] = factor * x[i];
  return 0;
}
