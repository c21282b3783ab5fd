"""ropekit plot: the PNG is written (function and command line), the q.k curve is the relative-position
property computed through the core op, and method specs parse or fail clearly."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import MODEL_CONFIGS
from ropekit.frequencies import from_hf_config, rope_frequencies
from ropekit.plot import binned_relative_position_curve, main, parse_method, plot_frequencies, relative_position_curve

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def read_png(path):
    image = pytest.importorskip("matplotlib.image")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return image.imread(path)


def test_plot_function_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    entries = {"default": rope_frequencies(64),
               "yarn x8": rope_frequencies(64, rope_type="yarn", factor=8.0, original_max_position_embeddings=512),
               "dynamic x2": rope_frequencies(64, rope_type="dynamic", factor=2.0, max_position_embeddings=512)}
    out = plot_frequencies(tmp_path / "sub" / "spectra.png", entries, max_distance=2048, samples=4, title="t")
    pixels = read_png(out)
    height, width = pixels.shape[:2]
    assert width > 1000 and height > 400
    assert pixels[..., :3].std() > 0.05  # something was drawn
    with pytest.raises(ValueError, match="at least one"):
        plot_frequencies(tmp_path / "x.png", {})
    with pytest.raises(TypeError, match="must be a RopeFrequencies"):
        plot_frequencies(tmp_path / "x.png", {"a": 3})


def test_cli_methods_and_configs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    cfg_dir = tmp_path / "phi-3.5-mini-instruct"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(json.dumps(MODEL_CONFIGS["phi-3.5-mini-instruct"]))
    out = tmp_path / "cli.png"
    code = main(["--out", str(out), "--method", "default:base=500000", "--method", "llama3:factor=8",
                 "--config", str(cfg_dir), "--context", "1024", "--max-distance", "8192", "--samples", "4"])
    assert code == 0
    assert capsys.readouterr().out.strip() == str(out)
    read_png(out)


def test_routed_through_ropekit_command(tmp_path):
    pytest.importorskip("matplotlib")
    from ropekit.cli import main as ropekit_main

    out = tmp_path / "routed.png"
    assert ropekit_main(["plot", "-o", str(out), "-m", "linear:factor=2", "--max-distance", "256",
                         "--samples", "2"]) == 0
    read_png(out)


def test_cli_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--out", str(tmp_path / "x.png"), "--method", "ntk:factor=2"])
    assert info.value.code == 2
    assert "rope type 'ntk' is not one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--config", str(tmp_path / "missing.json")])
    assert "missing.json" in capsys.readouterr().err


def test_relative_position_curve_is_the_core_op_property():
    f = from_hf_config(MODEL_CONFIGS["qwen2.5-7b-instruct-yarn"])  # attention scaling != 1
    dist = torch.tensor([0, 1, 2, 5, 77, 1000, 40_000])
    curve = relative_position_curve(f, dist, samples=16, seed=3)
    shifted = relative_position_curve(f, dist, samples=16, seed=3, start=123_457)
    torch.testing.assert_close(curve, shifted, rtol=0, atol=1e-9)  # depends on the distance only
    assert curve[0].item() == pytest.approx(1.0, abs=1e-12)
    # the closed form for the same heads: sum over pairs of s^2 (lo^2 + hi^2) cos(d theta_i)
    x = torch.randn(1, 1, 16, 128, generator=torch.Generator().manual_seed(3), dtype=torch.float64)[0, 0]
    energy = x[:, :64] ** 2 + x[:, 64:] ** 2  # [samples, pairs]
    theta = f.inv_freq.double()
    expected = (energy[None] * torch.cos(dist.double()[:, None, None] * theta)).sum(-1).mean(-1)
    torch.testing.assert_close(curve, expected / energy.sum(-1).mean(), rtol=1e-9, atol=1e-9)


def test_partial_rotary_curve_keeps_pass_through_energy():
    f = from_hf_config(MODEL_CONFIGS["gpt-neox-20b"])  # 24 of 96 columns rotated
    centres, curve = binned_relative_position_curve(f, 4096, samples=64)
    assert centres.numel() == curve.numel() > 30
    assert (centres[1:] > centres[:-1]).all()
    assert curve.min() > 0.6  # at least the ~3/4 of energy that never rotates


def test_parse_method():
    f = parse_method("yarn:factor=8,beta_fast=16,truncate=false", head_dim=64, context=2048)
    assert f.rope_type == "yarn" and f.parameters["beta_fast"] == 16 and f.parameters["truncate"] is False
    assert f.original_max_position_embeddings == 2048 and f.rotary_dim == 64
    g = parse_method("default:base=500000,rotary_dim=32,head_dim=128")
    assert g.base == 500000.0 and g.rotary_dim == 32 and g.head_dim == 128
    h = parse_method("llama3:factor=8")
    assert h.parameters["low_freq_factor"] == 1.0 and h.parameters["high_freq_factor"] == 4.0
    d = parse_method("dynamic:factor=2", context=1000)
    assert d.max_position_embeddings == 1000
    assert math.isclose(parse_method("default:freq_scale=0.5").inv_freq[0].item(), 0.5)
    with pytest.raises(ValueError, match="expected key=value"):
        parse_method("linear:4")
    with pytest.raises(ValueError, match="give factor="):
        parse_method("yarn")
    with pytest.raises(ValueError, match=r"does not read \['bogus'\]"):
        parse_method("linear:factor=2,bogus=1")


def test_config_label_of_a_bare_config_json(tmp_path, monkeypatch):
    from ropekit.plot import _load_config

    monkeypatch.chdir(tmp_path)
    cfg = dict(MODEL_CONFIGS["phi-3.5-mini-instruct"])
    cfg.pop("_name_or_path", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert _load_config("config.json")[0] == cfg["model_type"]  # the parent folder's name is "" here
    assert _load_config(".")[0] == cfg["model_type"]
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "model_type"}))
    assert _load_config("config.json")[0] == "config"
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, _name_or_path="org/model")))
    assert _load_config("config.json")[0] == "org/model"
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    assert _load_config("m/config.json")[0] == "m" and _load_config("m")[0] == "m"
    (tmp_path / "yarn-variant.json").write_text(json.dumps(cfg))
    assert _load_config("yarn-variant.json")[0] == "yarn-variant"


def test_cli_bare_config_json_keeps_a_legend_label(tmp_path, monkeypatch):
    import ropekit.plot as plot

    monkeypatch.chdir(tmp_path)
    cfg = {k: v for k, v in MODEL_CONFIGS["phi-3.5-mini-instruct"].items() if k != "_name_or_path"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    seen = {}
    monkeypatch.setattr(plot, "plot_frequencies", lambda out, entries, **kw: seen.setdefault("entries", entries))
    assert main(["--config", "config.json"]) == 0
    assert [label for label, _ in seen["entries"]] == [cfg["model_type"]]


def test_coincident_styles_take_turns():
    from ropekit.plot import coincident_styles

    x = torch.arange(4.0)
    same, other = (x, x * 2), (x, x * 3)
    styles = coincident_styles([same, other, same, (x, torch.tensor([0.0, 2.0, 4.0, 6.0 + 1e-12])), other],
                               ["-", "-", "-", "--", "-"], [2.0, 2.0, 1.0, 1.0, 1.5])
    assert styles[0] == "-" and styles[1] == "-"  # the first of each group is drawn as asked
    # three equal curves: the two on top dash in different slots of a 3-dash period, the first shows in the third
    (o2, (on2, off2)), (o3, (on3, off3)) = styles[2], styles[3]
    assert (on2, off2) == (on3, off3) and off2 == 2 * on2 and o2 != o3
    o5, (on5, off5) = styles[4]  # a pair: half and half, in the line's own width units
    assert on5 * 1.5 == off5 * 1.5 == 6.0 and o5 == 0


def test_default_plot_keeps_every_curve_visible(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import ropekit.plot as plot

    Figure, Canvas = plot._import_matplotlib()
    figures = []

    class Recorded(Figure):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            figures.append(self)

    monkeypatch.setattr(plot, "_import_matplotlib", lambda: (Recorded, Canvas))
    # dynamic scaling as built equals plain RoPE: its curves lie exactly on "default"'s in every panel
    entries = [("default", rope_frequencies(64)),
               ("dynamic", rope_frequencies(64, rope_type="dynamic", factor=4.0, max_position_embeddings=1024))]
    plot_frequencies(tmp_path / "p.png", entries, max_distance=1024, samples=2)
    for ax in figures[0].axes:
        lines = {line.get_label(): line for line in ax.get_lines()}
        default, dynamic = lines["default"], lines["dynamic"]
        assert (default.get_xydata() == dynamic.get_xydata()).all()
        assert default.get_linestyle() == "-" and dynamic.get_linestyle() != "-"
