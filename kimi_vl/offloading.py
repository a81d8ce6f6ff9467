"""`from_pretrained` refuses a `device_map` that offloads weights to the CPU or disk.

accelerate's offloading keeps an offloaded module's weights on the meta device and loads them only while that module
itself is called. These models read some submodules' weights inside their parents (the residual stream's AttnRes
queries, KDA's short-conv filters, MLA's absorbed decode weights, MoonViT's patch projection): offloaded, those reads
would find no weights, and the forward fails or computes on garbage.
"""

from __future__ import annotations

from .errors import ConfigError


def offloaded_modules(device_map: dict | None) -> list[str]:
    """The modules of a `device_map` (as `hf_device_map`) that accelerate offloads: those on `"disk"`, and those on
    `"cpu"` when the map also uses an accelerator (which then runs them)."""
    devices = {str(device) for device in (device_map or {}).values()}
    offloaded = ("disk",) if devices <= {"cpu", "disk"} else ("cpu", "disk")
    return [name for name, device in (device_map or {}).items() if str(device) in offloaded]


class RefusesOffloading:
    """Mixin of the `PreTrainedModel` classes: `from_pretrained(..., device_map=...)` raises `ConfigError` when the
    map offloads any weights (see the module docstring); maps that hold the whole model on devices are accepted."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, loading_info) with output_loading_info
        offloaded = offloaded_modules(getattr(model, "hf_device_map", None))
        if offloaded:
            raise ConfigError(
                f"device_map offloads {', '.join(offloaded[:4])}{' ...' if len(offloaded) > 4 else ''} to the CPU or "
                f"disk, which {cls.__name__} does not support (accelerate loads an offloaded module's weights only "
                "while that module is called, and this model reads some submodules' weights from their parents). "
                "Load it onto devices that hold it whole: more max_memory for the accelerators, a device_map without "
                "'cpu'/'disk' entries, or no device_map (the CPU)."
            )
        return loaded
