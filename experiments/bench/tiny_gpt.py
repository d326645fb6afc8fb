"""The tiny GPT's dimensions, token batches and optimizer: what the planner benchmark
(experiments/bench/planner_programs.py) and the tensor-, sequence- and pipeline-parallel tests
train."""

import numpy as np
import optax

VOCAB, WIDTH, HEADS, LAYERS, SEQ, BATCH, STEPS = 64, 32, 4, 2, 16, 16, 20


def adamw():
    # eps 1e-3, not 1e-8: Adam's first steps move a parameter by lr * g / (|g| + eps), which
    # turns rounding noise in a near-zero gradient into a change up to lr / eps times as large.
    # With eps 1e-8 even DDP on 8 devices differed from one device by 2e-3 relative; with 1e-4
    # the out-projection bias of stage:2,fsdp:2,tensor:2 (1F1B) by 1.1e-5 after 20 steps on an
    # AMD EPYC (3.9e-5 after the first: summation order's rounding, amplified). That is Adam's
    # sensitivity, not the layout's; at 1e-3 the same case is within 2.1e-6, and a wrong
    # gradient still moves parameters by orders of magnitude more than the 1e-5 the tests allow.
    return optax.chain(
        optax.clip_by_global_norm(0.5), optax.adamw(3e-3, eps=1e-3, weight_decay=0.1)
    )


def token_batches(seed=0, steps=STEPS, size=BATCH, seq=SEQ):
    rng = np.random.default_rng(seed)
    # Targets follow the inputs (a shifted copy with noise), so the model has something to learn.
    out = []
    for _ in range(steps):
        inputs = rng.integers(0, VOCAB, (size, seq)).astype(np.int32)
        targets = np.where(rng.random((size, seq)) < 0.7, (inputs + 1) % VOCAB, inputs)
        out.append({"inputs": inputs, "targets": targets.astype(np.int32)})
    return out
