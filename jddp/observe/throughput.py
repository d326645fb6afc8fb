"""Training speed between two logged steps: examples/s, tokens/s, model FLOP/s per device, MFU."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Throughput:
    """Rates for `steps` optimizer steps that took `seconds`.

    `tokens_per_example` is 0 for models without tokens; `flops_per_step` (global, see
    jddp/observe/flops.py) and `peak_flops_per_device` are None when unknown, and their rates are
    then left out.
    """

    examples_per_step: int
    num_devices: int
    tokens_per_example: int = 0
    flops_per_step: float | None = None
    peak_flops_per_device: float | None = None

    def rates(self, steps: int, seconds: float) -> dict[str, float]:
        seconds = max(seconds, 1e-9)
        examples_per_sec = steps * self.examples_per_step / seconds
        rates = {"examples_per_sec": examples_per_sec}
        if self.tokens_per_example:
            rates["tokens_per_sec"] = examples_per_sec * self.tokens_per_example
        if self.flops_per_step:
            per_device = steps * self.flops_per_step / seconds / self.num_devices
            rates["flops_per_sec_per_device"] = per_device
            if self.peak_flops_per_device:
                rates["mfu"] = per_device / self.peak_flops_per_device
        return rates
