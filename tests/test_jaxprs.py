"""The jaxpr helpers the passes share (``resireduce_jax._src.jaxprs``): which equations give
a body to each pass, and the sizes of values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from resireduce_jax._src import jaxprs, varying_dependence


def _eqn(fn, *args, name):
    (eqn,) = [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == name]
    return eqn


def test_plain_calls_give_their_body():
    eqn = _eqn(jax.jit(lambda x, y: (x * y, x + y)), 1.0, 2.0, name="jit")
    key, body = jaxprs.call_body(eqn)
    assert key == "jaxpr"
    assert (len(body.invars), len(body.outvars)) == (2, 2)
    assert jaxprs.call_body(eqn, jaxprs.PLAIN_CALLS) == (key, body)


def test_checkpoint_is_a_plain_call_not_followed_by_varying_dependence():
    eqn = _eqn(jax.checkpoint(lambda x: jnp.sin(x)), 1.0, name="remat2")
    assert jaxprs.call_body(eqn, jaxprs.PLAIN_CALLS)[0] == "jaxpr"
    assert jaxprs.call_body(eqn, varying_dependence._CALLS) is None


def test_custom_derivative_calls_are_not_plain():
    eqn = _eqn(jax.grad(lambda x: jax.nn.relu(x)), 1.0, name="custom_jvp_call")
    assert jaxprs.call_body(eqn)[0] == "call_jaxpr"
    assert jaxprs.call_body(eqn, jaxprs.PLAIN_CALLS) is None


def test_any_primitive_takes_a_scan_body_but_not_a_cond():
    def scanned(x):
        return jax.lax.scan(lambda c, _: (c * 2.0, c), x, None, length=3)

    scan = _eqn(scanned, 1.0, name="scan")
    assert jaxprs.call_body(scan) is None
    key, body = jaxprs.call_body(scan, None)
    assert key == "jaxpr" and len(body.invars) == len(scan.invars)
    cond = _eqn(lambda p, x: jax.lax.cond(p, jnp.sin, jnp.cos, x), True, 1.0, name="cond")
    assert jaxprs.call_body(cond, None) is None


def test_sizes():
    aval = jax.ShapeDtypeStruct((3, 5), jnp.bfloat16)
    assert jaxprs.aval_size(aval) == 15
    assert jaxprs.aval_nbytes(aval) == 30
    assert jaxprs.aval_size(jax.ShapeDtypeStruct((), np.float32)) == 1
    assert jaxprs.aval_size(object()) is None
    assert jaxprs.aval_nbytes(object()) == 0
