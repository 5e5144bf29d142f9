"""The README's API tour (examples/api_tour.py) runs as written."""

import pathlib
import runpy


def test_api_tour_runs(capsys):
    runpy.run_path(str(pathlib.Path(__file__).parents[2] / "examples" / "api_tour.py"))
    out = capsys.readouterr().out
    assert "padding rows are zeros: True" in out
    assert "selection equals the reference: True" in out
    assert "padding rows select nothing: True" in out
    assert "decode row 1 (token 999) selects [7 " in out and "... equals the reference: True" in out  # own block first
    assert "decode row equals sparse_decode: True" in out
    assert "full attention (8, 16, 128) equals every block selected: True" in out
    assert "gfx950 serves this geometry: True" in out
    assert ("mixed batch rows: requests [ 0  1  1  1  1  1 -1 -1] "
            "positions [299 995 996 997 998 999  -1  -1]") in out
    assert "grouped as argsort would: True | weights sum to 1: True" in out
    assert "grouped matmul (10, 32) row 0 is token 0 through expert 0 : True" in out
    assert "equals the call on the sorted copy: True" in out
    assert "MXFP8 grouped matmul equals the bf16 call on mxfp8_dequantize: True" in out
    assert "MXFP4 grouped matmul equals the bf16 call on fp4_dequantize: True" in out
    assert "grouped matmul with a SwiGLU epilogue (10, 32) equals silu(gate) · up · weight: True" in out
    assert "dense_matmul (5, 96) within fp32 rounding of numpy: True" in out


def test_serve_sharded_runs(capsys):
    """README "Serving on many devices": M3's heads at TP 8, no collective, one-device result."""
    runpy.run_path(str(pathlib.Path(__file__).parents[2] / "examples" / "serve_sharded.py"))
    out = capsys.readouterr().out
    assert "collectives in the compiled step: 0" in out
    assert "0.56 of 4.50 MiB per device" in out
    assert "equal to one device: True" in out
