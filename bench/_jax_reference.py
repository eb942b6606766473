"""The hand-written JAX step the benchmarks compare with: an MLP of (weight, bias)
pairs with tanh, the mean square of its output as the loss, one `jax.jit` of the
loss's gradient and an optax optimizer, parameters and optimizer state donated
(`donate_argnums`), parameters replicated and the batch split over 4 devices."""


def mesh_shardings():
  """(replicated, batch-split) shardings over the first 4 devices."""
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  mesh = Mesh(jax.devices()[:4], ("d",))
  return NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("d"))


def mlp_loss(params, x):
  import jax.numpy as jnp

  h = x
  for w, b in params:
    h = jnp.tanh(h @ w.T + b)
  return jnp.mean(h**2)


def donated_step(opt):
  """One training step with optax's `opt`, jitted, params and state donated:
  `step(params, state, x) -> (params, state, loss)`."""
  import jax
  import optax

  def step(params, state, x):
    loss, grads = jax.value_and_grad(mlp_loss)(params, x)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return jax.jit(step, donate_argnums=(0, 1))
