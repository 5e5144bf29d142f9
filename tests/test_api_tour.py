"""The README's API tour (examples/api_tour.py) runs as written."""

import pathlib
import runpy


def test_api_tour_runs(capsys):
    runpy.run_path(str(pathlib.Path(__file__).parents[1] / "examples" / "api_tour.py"))
    out = capsys.readouterr().out
    assert "padding rows are zeros: True" in out
    assert "decode row equals sparse_decode: True" in out
    assert "gfx950 serves this geometry: True" in out
