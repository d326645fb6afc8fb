"""Exact peaks where the step compiles here: each layout's real train step compiled for N
simulated CPU devices and XLA's `memory_analysis` read (an accelerator's compiler fuses
differently, so treat the peak as close, not exact, there). Minutes for big models: the CLI
does it for up to 8 devices unless told otherwise."""

import copy

from jddp.planner.layouts import Layout


def compiled_peaks(config, layouts: list[Layout]) -> dict[str, int]:
    """{layout name: the compiled step's peak bytes per device} for the layouts jddp runs
    today (no stage axis); needs `jax.device_count()` equal to the layouts' devices."""
    import jax
    import numpy as np

    from jddp import data, optim
    from jddp.errors import ConfigError
    from jddp.experiment import build_trainer
    from jddp.memory import peak_bytes

    dataset = data.get_dataset(config.dataset, config.data.get("text_file", ""))
    schedule = optim.learning_rate_schedule(config)
    if dataset.kind == data.LANGUAGE_MODEL:
        tokens = np.zeros((1, config.data.seq_len), np.int32)
        sample = {"inputs": tokens, "targets": tokens}
    else:  # one real example gives the shapes (the dataset is prepared if it is not yet)
        options = data.DataOptions.from_config(config.data)
        sample = data.open_dataset(dataset, options).sample_batch()
    batch = {
        name: jax.ShapeDtypeStruct(
            (config.global_batch_size, *np.shape(x)[1:]), np.asarray(x).dtype
        )
        for name, x in sample.items()
    }
    peaks = {}
    for layout in layouts:
        if layout.stage > 1:
            continue
        variant = copy.deepcopy(config)
        variant.parallel.sequence_parallel = layout.sequence_parallel
        mesh = None if layout.strategy == "ddp" else layout.mesh_spec
        try:
            trainer = build_trainer(variant, dataset, schedule, strategy=layout.strategy, mesh=mesh)
            state = trainer.abstract_state(sample)
        except ConfigError:
            continue  # the model does not split this way
        placed = trainer.strategy.abstract_batch(batch)
        peaks[layout.name] = peak_bytes(trainer.strategy.lower_train_step(state, placed).compile())
    return peaks
