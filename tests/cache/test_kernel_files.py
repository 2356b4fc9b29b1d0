"""MLX's factory gets a kernel's header and body as #include lines of files that hold the
compacted texts (cache/kernel_files.py): what nvrtc compiles once the includes are expanded is
the inline text, and MLX declares the same shape parameters. The `<method>-inline` ablation's
compiled launch hands the text inline, for the A/B (on the GPU: the same outputs)."""

import re

import mlx.core as mx
import pytest

from tests.cache.cuda_marks import cuda_test
from tests.cache.model_decode import assert_same_attention, decode_outputs
from veloxquant_mlx.bench.ablations import WINDOW_METHODS
from veloxquant_mlx.bench.layer_specs import parse_layer_spec
from veloxquant_mlx.cache import fused_decode, fused_decode_gear, kernel_files, kernel_name
from veloxquant_mlx.cache.kernel_text import compact_kernel_text
from veloxquant_mlx.errors import QuantizerConfigError

INCLUDE = re.compile(r'^#include "([^"]+)"$', re.M)


def _expanded(text: str) -> str:
    """`text` with each #include line of ours replaced by the file's text (the preprocessor's
    work, for a file that ends in its line break)."""
    return INCLUDE.sub(lambda m: open(m.group(1)).read().rstrip("\n"), text)


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """build_kernel's calls of MLX's factory, recorded (the factory stood in by a recorder that
    build_kernel takes for MLX's), the text folder a temporary one."""
    calls = []

    def factory(**arguments):
        calls.append(arguments)
        return arguments

    monkeypatch.setattr(kernel_name, "_MLX_FACTORY", factory)
    monkeypatch.setenv(kernel_files.ENV_FOLDER, str(tmp_path / "texts"))
    monkeypatch.delenv(kernel_files.ENV_SWITCH, raising=False)
    return factory, calls


def test_the_decode_kernel_is_handed_over_as_includes_of_its_compacted_text(recorded, tmp_path):
    factory, calls = recorded
    kernel = fused_decode_gear._partials_kernel()
    source, header, names = kernel.fused_source(), kernel.header, kernel.input_names
    built = kernel_name.build_kernel(factory, name="vq_test_gear", input_names=names, output_names=["out"],
                                     source=source, header=header)
    inline_source, inline_header = compact_kernel_text(source), compact_kernel_text(header)
    # The name is the inline build's (the same digest: MLX's caches keep serving one binary).
    assert built["name"] == kernel_name.source_keyed_name("vq_test_gear", inline_source, inline_header)
    assert len(built["source"]) < 600 and len(built["header"]) < 200
    assert _expanded(built["header"]) == inline_header
    # The body: its include, then a comment naming the parameters it reads.
    expanded = _expanded(built["source"])
    assert expanded.startswith(inline_source)
    assert kernel_files.shape_parameters(built["source"], names) == kernel_files.shape_parameters(inline_source, names)
    assert kernel_files.shape_parameters(inline_source, names)  # the check has something to compare
    assert {p.name for p in (tmp_path / "texts").iterdir()} == {built["name"] + ".body.cuh",
                                                                built["name"] + ".header.cuh"}


def test_a_stale_file_is_rewritten_and_a_matching_one_kept(recorded, tmp_path):
    factory, _ = recorded
    built = kernel_name.build_kernel(factory, name="vq_k", input_names=["x"], output_names=["y"],
                                     source="out[0] = x_shape[0];", header="#define A 1")
    body = tmp_path / "texts" / (built["name"] + ".body.cuh")
    assert body.read_text() == "out[0] = x_shape[0];\n" and built["source"].endswith("// x_shape\n")
    body.write_text("out[0] = 2;")  # another text under the name: a partial or tampered file
    kernel_name.build_kernel(factory, name="vq_k", input_names=["x"], output_names=["y"],
                             source="out[0] = x_shape[0];", header="#define A 1")
    assert body.read_text() == "out[0] = x_shape[0];\n"
    stamp = body.stat().st_mtime_ns
    kernel_name.build_kernel(factory, name="vq_k", input_names=["x"], output_names=["y"],
                             source="out[0] = x_shape[0];", header="#define A 1")
    assert body.stat().st_mtime_ns == stamp
    assert not [p for p in body.parent.iterdir() if p.suffix == ".tmp"]


def test_an_empty_header_stays_empty(recorded):
    factory, _ = recorded
    built = kernel_name.build_kernel(factory, name="vq_k", input_names=["x"], output_names=["y"], source="s")
    assert built["header"] == "" and built["source"].startswith("#include ")


def test_the_switch_off_hands_the_text_inline_and_a_stand_in_always_gets_it(recorded, monkeypatch):
    factory, calls = recorded
    monkeypatch.setenv(kernel_files.ENV_SWITCH, "0")
    built = kernel_name.build_kernel(factory, name="vq_k", input_names=["x"], output_names=["y"], source="s")
    assert built["source"] == "s\n"
    monkeypatch.setenv(kernel_files.ENV_SWITCH, "1")
    other = kernel_name.build_kernel(lambda **a: a, name="vq_k", input_names=["x"], output_names=["y"], source="s")
    assert other["source"] == "s\n"  # not MLX's factory (the tests' CPU emulation): inline
    verbatim = kernel_name.build_kernel(factory, name="vq_k", input_names=["x"], output_names=["y"],
                                        source="s // c", compact=False)
    assert verbatim["source"] == "s // c"  # the verbatim ablation's text as written


def test_a_bad_switch_value_is_an_error_naming_what_is_allowed(recorded, monkeypatch):
    factory, _ = recorded
    monkeypatch.setenv(kernel_files.ENV_SWITCH, "yes")
    with pytest.raises(QuantizerConfigError, match=r"VELOXQUANT_KERNEL_TEXT_FILES='yes' is invalid: allowed is 0"):
        kernel_name.build_kernel(factory, name="vq_k", input_names=["x"], output_names=["y"], source="s")


def test_an_unwritable_folder_is_an_error_naming_it_and_the_way_out(recorded, monkeypatch, tmp_path):
    factory, _ = recorded
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(kernel_files.ENV_FOLDER, str(blocker / "texts"))
    with pytest.raises(QuantizerConfigError, match=r"cannot create the kernel text folder .*a_file/texts.*"
                                                   r"VELOXQUANT_KERNEL_TEXT_FILES=0"):
        kernel_name.build_kernel(factory, name="vq_k", input_names=["x"], output_names=["y"], source="s")


def test_the_inline_ablation_sets_the_caches_switch():
    cache = parse_layer_spec("gear-inline").make(0, 1)
    assert cache.kernel_text_inline is True


def test_the_inline_build_is_the_counted_build_with_its_text_inline(recorded, monkeypatch):
    factory, _ = recorded
    monkeypatch.setattr(mx.fast, "cuda_kernel", factory)
    kernel = fused_decode.PartialsKernel("vq_test_partials", ["q", "wn"], "out[0] = wn_shape[0];", "#define H 1")
    shipped, inline = kernel.counted, kernel.counted_inline
    assert shipped["name"] == inline["name"]  # one code: MLX's module cache serves both
    assert shipped["source"].startswith("#include ") and "wn_shape" in shipped["source"]
    assert shipped["header"].startswith("#include ")
    assert _expanded(shipped["source"]).startswith(inline["source"]) and _expanded(shipped["header"]) == inline["header"]


@cuda_test
@pytest.mark.parametrize("method", WINDOW_METHODS)
def test_the_inline_launch_gives_the_shipped_launchs_output_on_the_gpu(method, monkeypatch):
    # The decode steps' compiled launches: which build each step's replayed function holds.
    builds = []
    attend = fused_decode.PartialsKernel.attend
    monkeypatch.setattr(fused_decode.PartialsKernel, "attend", lambda self, *a, **k: (
        builds.append((k.get("compiled"), k.get("inline")))) or attend(self, *a, **k))
    shipped, _ = decode_outputs(method, {"kernel_text_inline": False}, steps=2)
    inline, _ = decode_outputs(method, {"kernel_text_inline": True}, steps=2)
    assert (True, True) in builds and (True, False) in builds
    assert_same_attention(shipped, inline)


def test_a_folder_of_another_user_is_an_error(recorded, monkeypatch):
    factory, _ = recorded
    monkeypatch.setattr(kernel_files.os, "getuid", lambda: 4242)  # the folder is then another user's
    with pytest.raises(QuantizerConfigError, match=r"belongs to another user .*this process runs as 4242"):
        kernel_name.build_kernel(factory, name="vq_k", input_names=["x"], output_names=["y"], source="s")
