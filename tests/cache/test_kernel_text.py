"""The kernels' text as handed to MLX: comments and indentation gone, code and strings kept."""

from veloxquant_mlx.cache import fused_decode
from veloxquant_mlx.cache.kernel_name import build_kernel, source_keyed_name
from veloxquant_mlx.cache.kernel_text import compact_kernel_text


def test_comments_indentation_and_empty_lines_are_removed():
    text = "// why this kernel\n\n  int a = 1;  // the count\n    if (a) {\n\n      a += 2;\n    }\n"
    assert compact_kernel_text(text) == "int a = 1;\nif (a) {\na += 2;\n}\n"


def test_strings_and_character_literals_keep_their_slashes():
    text = '  asm volatile("ld.global // not a comment \\" still string");  // cut\n  char c = \'/\'; // cut\n'
    assert compact_kernel_text(text) == 'asm volatile("ld.global // not a comment \\" still string");\nchar c = \'/\';\n'


def test_preprocessor_lines_and_continuations_keep_their_breaks():
    text = "#define TWICE(x) \\\n    ((x) + (x))\n#undef TWICE\n"
    assert compact_kernel_text(text) == "#define TWICE(x) \\\n((x) + (x))\n#undef TWICE\n"


def test_text_of_comments_only_is_empty():
    assert compact_kernel_text("  // nothing\n\n") == ""


def test_compacting_twice_changes_nothing():
    once = compact_kernel_text(fused_decode._PARTIALS)
    assert compact_kernel_text(once) == once


def test_the_decode_kernels_text_shrinks_by_a_third_or_more():
    # Session 35's measure on the CPU: the affine decode launch's header + body ~56 KB -> ~31 KB.
    before = len(fused_decode._HEADER) + len(fused_decode._PARTIALS)
    after = len(compact_kernel_text(fused_decode._HEADER)) + len(compact_kernel_text(fused_decode._PARTIALS))
    assert after < 0.67 * before


def test_build_kernel_hands_the_factory_compacted_text_under_its_digest():
    received = {}

    def factory(**arguments):
        received.update(arguments)
        return "kernel"

    source, header = "  out[0] = 1;  // write\n", "// header\n#define ONE 1\n"
    assert build_kernel(factory, name="vq_test", source=source, header=header, input_names=["a"]) == "kernel"
    assert received["source"] == "out[0] = 1;\n"
    assert received["header"] == "#define ONE 1\n"
    assert received["input_names"] == ["a"]
    assert received["name"] == source_keyed_name("vq_test", "out[0] = 1;\n", "#define ONE 1\n")
