"""Exact peaks where the step compiles here: each layout's real train step compiled for N
simulated CPU devices and XLA's `memory_analysis` read (an accelerator's compiler fuses
differently, so treat the peak as close, not exact, there). Minutes for big models: the CLI
does it for up to 8 devices unless told otherwise."""

import copy

from jddp.planner.layouts import Layout


def compiled_peaks(config, layouts: list[Layout]) -> dict[str, int]:
    """{layout name: the compiled step's peak bytes per device} for the layouts jddp runs
    today (no stage axis); needs `jax.device_count()` equal to the layouts' devices."""

    from jddp.errors import ConfigError
    from jddp.observe.memory import peak_bytes
    from jddp.run import factory

    dataset = factory.dataset_spec(config)
    sample = factory.sample_batch(config, dataset)
    batch = factory.global_batch_shapes(sample, config.global_batch_size)
    peaks = {}
    for layout in layouts:
        if layout.stage > 1:
            continue
        variant = copy.deepcopy(config)
        variant.parallel.sequence_parallel = layout.sequence_parallel
        variant.parallel.context_attention = layout.context_attention
        mesh = None if layout.strategy == "ddp" else layout.mesh_spec
        try:
            trainer = factory.build_trainer(variant, dataset, strategy=layout.strategy, mesh=mesh)
            state = trainer.abstract_state(sample)
        except ConfigError:
            continue  # the model does not split this way
        placed = trainer.strategy.abstract_batch(batch)
        peaks[layout.name] = peak_bytes(trainer.strategy.lower_train_step(state, placed).compile())
    return peaks
