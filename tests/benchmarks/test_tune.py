"""benchmarks/tune: config texts -> the arguments a variant runs with, and one interpret-mode run."""
import dataclasses
import json
import types

import jax.numpy as jnp
import pytest

from benchmarks import tune
from pallas_kernels import registry


@dataclasses.dataclass(frozen=True)
class _Cfg:
    tile_k: int = 256
    k_splits: int = 1
    swizzle: bool = True
    decode: str = "wgmma"


def _dataclass_variant():
    def default_config(m, n, k, blocksize, tile_k=None):
        tile_k = tile_k or 256
        return _Cfg(tile_k=tile_k, k_splits=k // tile_k // 4)
    return types.SimpleNamespace(name="fake", fn=lambda x, *, config=None: x,
                                 config_type=_Cfg, default_config=default_config)


def test_parse_configs_expands_grids_in_order():
    assert tune.parse_configs("default; default,a=1 ;b=2|3,c=4|5;") == [
        "default", "default,a=1", "b=2,c=4", "b=2,c=5", "b=3,c=4", "b=3,c=5"]
    with pytest.raises(ValueError, match="names no config"):
        tune.parse_configs(" ; ")


def test_dataclass_config_default_replace_and_fields_alone():
    v = _dataclass_variant()
    assert tune.resolve_config(v, "default", 16, 4096, 4096, 64) == {
        "config": _Cfg(tile_k=256, k_splits=4)}
    # a field default_config also takes steers the default; the others are replaced, typed
    # like the default's value
    got = tune.resolve_config(v, "default,tile_k=512,swizzle=0,decode=rows", 16, 4096, 4096, 64)
    assert got == {"config": _Cfg(tile_k=512, k_splits=2, swizzle=False, decode="rows")}
    assert tune.resolve_config(v, "k_splits=3", 16, 4096, 4096, 64) == {"config": _Cfg(k_splits=3)}


def test_dataclass_config_rejects_unknown_and_mistyped_fields():
    v = _dataclass_variant()
    with pytest.raises(ValueError, match=r"\['tile_n'\] are not fields of _Cfg"):
        tune.resolve_config(v, "default,tile_n=128", 16, 4096, 4096, 64)
    with pytest.raises(ValueError, match="expected int"):
        tune.resolve_config(v, "default,k_splits=two", 16, 4096, 4096, 64)
    with pytest.raises(ValueError, match="expected a bool"):
        tune.resolve_config(v, "default,swizzle=yes", 16, 4096, 4096, 64)
    with pytest.raises(ValueError, match="is not field=value"):
        tune.resolve_config(v, "default,tile_k", 16, 4096, 4096, 64)


def test_keyword_config_of_a_registered_variant():
    v = registry.get("gemv_block_scaled")
    assert v.config_type is None
    base = v.default_config(1, 4096, 4096, 64)
    assert tune.resolve_config(v, "default", 1, 4096, 4096, 64) == base
    assert tune.resolve_config(v, "default,block_n=16", 1, 4096, 4096, 64) == {**base, "block_n": 16}
    assert tune.resolve_config(v, "block_n=32,fma=false,lookup=prmt", 1, 4096, 4096, 64) == {
        "block_n": 32, "fma": False, "lookup": "prmt"}
    with pytest.raises(ValueError, match=r"\['tile_k'\] are not keyword arguments"):
        tune.resolve_config(v, "tile_k=512", 1, 4096, 4096, 64)


def test_interpret_run_checks_and_times_each_config(tmp_path):
    out = tmp_path / "tune.json"
    assert tune.main(["--variant", "gemv_block_scaled", "--configs", "default;block_n=32;bogus=1",
                      "--ms", "1", "--shapes", "256:128", "--interpret", "--iterations", "1",
                      "--against", "xla", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert (row["k"], row["n"], row["m"]) == (256, 128, 1)
    assert isinstance(row["bf16_us"], float)
    for text in ("default", "block_n=32"):
        rec = row["configs"][text]
        assert rec["rel_err"] < 1e-2 and isinstance(rec["us"], float) and rec["ratio"] > 0
    assert "not keyword arguments" in row["configs"]["bogus=1"]["error"]
    assert "us" not in row["configs"]["bogus=1"]
    assert row["against"]["xla"]["ratio"] > 0


def test_a_config_that_fails_the_reference_check_is_not_timed():
    broken = dataclasses.replace(
        registry.get("gemv_block_scaled"), name="broken",
        fn=lambda x, packed, *a, **kw: jnp.zeros((x.shape[0], packed.shape[0]), x.dtype))
    (row,) = tune.tune(broken, ["default"], [1], [(256, 128)], interpret=True, iterations=1,
                       log=lambda s: None)
    rec = row["configs"]["default"]
    assert rec["error"].startswith("check failed") and "us" not in rec


def test_bwd_flag_must_match_the_variant_op():
    with pytest.raises(SystemExit):
        tune.main(["--variant", "dequant_dot_t", "--interpret"])
    with pytest.raises(SystemExit):
        tune.main(["--variant", "gemv_block_scaled", "--bwd", "--interpret"])
