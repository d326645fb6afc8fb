"""One process of a multi-process test job (started by jddp-launch from test_multiprocess.py):
trains the reference SmallNet on this process's rows of the shared global batches and, in
process 0, writes the losses, the initial and final parameters and the addresses its
coordinator listens on (as /proc/net/tcp* show them, where they exist) to ARGV[2] (.npz).
ARGV[3], optional: more `jddp.Trainer` options as JSON (e.g. gradient compression)."""

import ipaddress
import json
import os
import sys

from jddp.runtime import processes as runtime

runtime.initialize()  # from the JDDP_* variables jddp-launch sets


def listening_addresses(port: int) -> list[str]:
    """The addresses that sockets listening on TCP `port` are bound to, as `ss -ltn` shows them
    (an IPv4 address mapped into IPv6, ::ffff:a.b.c.d, as a.b.c.d)."""
    found = []
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            # The kernel prints each 32-bit word of the address as a number in the machine's
            # byte order.
            words = [bytes.fromhex(address[i : i + 8]) for i in range(0, size * 2, 8)]
            raw = b"".join(w[::-1] if sys.byteorder == "little" else w for w in words)
            ip = ipaddress.ip_address(raw)
            found.append(str(getattr(ip, "ipv4_mapped", None) or ip))
    return sorted(found)


COORDINATOR_PORT = int(os.environ["JDDP_COORDINATOR_ADDRESS"].rsplit(":", 1)[1])
COORDINATOR_LISTENS = listening_addresses(COORDINATOR_PORT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jddp  # noqa: E402
from jddp.checkpoints.compatibility import shapes_by_path  # noqa: E402
from tests.reference import (  # noqa: E402
    TENSOR_RULES,
    SmallNet,
    TensorNet,
    make_batches,
    optimizer_for,
    per_example_ce,
)


def flat(tree) -> dict[str, np.ndarray]:
    paths = shapes_by_path(tree)
    return dict(zip(paths, (np.asarray(x) for x in jax.tree.leaves(tree)), strict=True))


def main(strategy: str, out: str, more_options: str = "{}") -> None:
    """`strategy` is a name, or `NAME@MESH` for TensorNet with its tensor rules on MESH;
    `more_options` Trainer keywords as JSON."""
    strategy, _, mesh = strategy.partition("@")
    options = {"min_shard_size": 1} if strategy != "ddp" else {}
    if mesh:
        options |= {"mesh": mesh, "rules": TENSOR_RULES}
    options.update(json.loads(more_options))
    trainer = jddp.Trainer(
        TensorNet() if mesh else SmallNet(),
        per_example_ce,
        optimizer_for(clip=True),
        strategy=strategy,
        grad_accum_steps=2,
        **options,
    )
    part, parts = trainer.row_block
    batches = make_batches()
    rows = len(batches[0]["label"]) // parts

    def mine(batch):
        return {k: v[part * rows : (part + 1) * rows] for k, v in batch.items()}

    state = trainer.init(seed=0, sample_batch=mine(batches[0]))
    initial = trainer.host_state(state).params
    losses = []
    for batch in batches:
        state, metrics = trainer.step(state, mine(batch))
        losses.append(float(metrics["loss"]))
    final = trainer.host_state(state).params
    if jax.process_index() == 0:
        np.savez(
            out,
            losses=np.array(losses),
            coordinator_listens=np.array(COORDINATOR_LISTENS),
            **{f"initial/{k}": v for k, v in flat(initial).items()},
            **{f"final/{k}": v for k, v in flat(final).items()},
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
