"""Tokens/s of the official JAX code's own training step at the sizes of
`tvq bench`'s model, for same-run comparisons (scripts/against-official.sh).

The step is the official `train_op` (forward, backward, global-norm
clipping, AdamW, the EMA codebook update), with `update_len = sequence_len`
as `tvq bench` takes one optimizer step per T tokens, the gradient through
the compressed cache (`grad_thru_cache = 1`, what tvq's
`model.cache_grad = "full"` computes) and no dropout. Model: batch 4,
d_model 256, d_k 64, d_v 512, 2 layers (4 GAU sublayers), S = 128 codes,
L = M = 128, vocabulary 259; the token ids follow `tvq bench`'s pattern.

    python scripts/official_step.py OFFICIAL_SRC T [T ...]

OFFICIAL_SRC is the `src` folder of a checkout of
github.com/transformer-vq/transformer_vq (commit 21943e4). It needs
jax/jaxlib 0.4.13 (the oldest with Python 3.11 wheels; the official code
pins 0.4.9), flax 0.6.11, optax 0.1.5, numpy < 1.25, scipy < 1.12.
Env: STEPS, timed steps per length after a compiling warm-up (default 3).
Prints one line per T: `official T TOKENS_PER_S tok/s loss LOSS`.
"""
import os
import sys
import time

sys.path.insert(0, sys.argv[1])
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import jax_utils  # noqa: E402
from flax.training import common_utils  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402
from transformer_vq.nn.model import Transformer  # noqa: E402
from transformer_vq.nn.types import TransformerConfig  # noqa: E402
from transformer_vq.nn.vq import VQSpec  # noqa: E402
from transformer_vq.ops.train import train_op  # noqa: E402
from transformer_vq.utils.tree import flattened_traversal  # noqa: E402

ROWS, VOCAB, BLOCK = 4, 259, 128
STEPS = int(os.environ.get("STEPS", "3"))


def config(seq_len, block_len=BLOCK):
    return TransformerConfig.create(
        param_dtype="float32", dtype="float32", global_batch_size=ROWS,
        sequence_len=seq_len, update_len=seq_len, block_len=block_len,
        mem_len=BLOCK, grad_thru_cache=1, agg_cache=1, d_model=256, d_k=64,
        d_v=512, d_ff=0, n_head=1, n_code=128, n_layer=2, n_vocab=VOCAB,
        pe_abs=0, pe_lam=100000, p_dropemb=0.0, p_dropsin=0.0, p_dropres=0.0,
        p_droplyr=0.0, p_nucleus=0.9, c_beta=0.0001, c_gamma=0.99, e_tie=0,
        e_preln=0, e_scale=1.0, is_train=True,
    )


def train_state():
    """Parameters and optimizer as the official launch script builds them."""
    cfg = config(8, block_len=8)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    rngs = dict(params=keys[0], ephemeral=keys[1], timeless=keys[2])
    params = Transformer(cfg).init(
        rngs,
        inputs=jnp.zeros([1, 8], jnp.int32),
        doc_ids=jnp.zeros([1, 8], jnp.int32),
        state=Transformer.initial_state(config=cfg, batch_size=1),
        vq_spec=VQSpec.create(
            n_device=jnp.array([1]),
            n_block_per_update=jnp.array([1]),
            loss_mask=jnp.ones([1, 8], jnp.int32),
        ),
    )["params"].unfreeze()
    labels = flattened_traversal(
        lambda path, _: "codebook" if path[-1].startswith("c_") else "main"
    )
    main = optax.chain(
        optax.clip_by_global_norm(0.1),
        optax.adamw(4e-4, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0),
    )
    tx = optax.multi_transform(
        {"main": main, "codebook": optax.sgd(learning_rate=1.0)}, param_labels=labels
    )
    return TrainState.create(apply_fn=None, params=params, tx=tx)


def tokens_per_s(seq_len):
    cfg = config(seq_len)
    ids = np.arange(ROWS * (seq_len + 1)) * 31 % VOCAB
    ids = ids.reshape(ROWS, seq_len + 1).astype(np.int32)
    batch = common_utils.shard(
        dict(
            inputs=ids[:, :-1],
            targets=ids[:, 1:],
            loss_mask=np.ones([ROWS, seq_len], np.int32),
            doc_ids=np.zeros([ROWS, seq_len], np.int32),
        )
    )
    rng = common_utils.shard_prng_key(jax.random.PRNGKey(3))
    state = jax_utils.replicate(train_state())

    def step(state):
        out = train_op(cfg, train_state=state, batch=batch, rng=rng)
        return jax.block_until_ready(out)

    state, metrics = step(state)  # compiles
    start = time.perf_counter()
    for _ in range(STEPS):
        state, metrics = step(state)
    secs = time.perf_counter() - start
    loss = float(jax_utils.unreplicate(metrics)["loss_lm_per_token_unscaled"])
    return STEPS * ROWS * seq_len / secs, loss


for t in sys.argv[2:]:
    rate, loss = tokens_per_s(int(t))
    print(f"official {t} {rate:.0f} tok/s loss {loss:.4f}", flush=True)
