"""Kernel names carry a digest of their source, so MLX's module cache (keyed by name and
template values alone) never serves one source's binary for another."""
from veloxquant_mlx.cache import gear_prefill_kernel
from veloxquant_mlx.cache.kernel_name import base_name, build_kernel, source_keyed_name


def test_equal_sources_share_a_name_different_ones_do_not():
    a = source_keyed_name("vq_k", "out[0] = 1;", "// h")
    assert a == source_keyed_name("vq_k", "out[0] = 1;", "// h")
    assert a != source_keyed_name("vq_k", "out[0] = 2;", "// h")
    assert a != source_keyed_name("vq_k", "out[0] = 1;", "// other header")
    assert base_name(a) == "vq_k"


def test_build_kernel_passes_the_keyed_name_and_everything_else():
    seen = {}

    def factory(**arguments):
        seen.update(arguments)
        return "built"

    # The source as handed over: compacted (kernel_text), one line ending in its break.
    assert build_kernel(factory, name="vq_k", input_names=["x"], output_names=["y"], source="s") == "built"
    assert seen == {"name": source_keyed_name("vq_k", "s\n"), "input_names": ["x"], "output_names": ["y"],
                    "source": "s\n", "header": ""}


def test_a_source_built_from_arguments_gets_a_name_per_source():
    # gear's prefill kernel: one written name, a source per block-count input.
    names = set()

    def factory(**arguments):
        names.add(arguments["name"])

    for blocks_from in ("koi", "voi"):
        gear_prefill_kernel._kernel_for(factory, blocks_from)
    assert len(names) == 2 and {base_name(n) for n in names} == {"vq_gear_prefill_kv"}
