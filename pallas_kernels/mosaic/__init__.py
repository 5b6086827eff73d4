"""Kernels in the Pallas Mosaic GPU lowering: Hopper (sm90) only, TMA and inline PTX; no interpret
mode. `available()` says whether this process can run them (`registry.platform_available`)."""


def available() -> bool:
    """Whether this process can run the Mosaic GPU kernels: a Hopper GPU (wgmma is sm_90 only) as
    the default device, and a jax whose Mosaic GPU has the pieces the kernels use."""
    import jax

    from pallas_kernels.mosaic.mgpu_decode import mosaic_modules

    if jax.default_backend() != "gpu":
        return False
    cc = getattr(jax.devices()[0], "compute_capability", "")
    if not str(cc).startswith("9."):
        return False
    try:
        _, _, plgpu, *_ = mosaic_modules()
    except Exception:  # noqa: BLE001 - a jax without Mosaic GPU
        return False
    return all(hasattr(plgpu, name) for name in ("inline_mgpu", "emit_pipeline_warp_specialized"))
