"""What MLX is handed as a kernel's source (mlx_dsv41/kernels/source_text.py): comments gone, dead
conditional branches gone, and only the header items the body reaches. tests/test_kernel_sources.py
compiles every kernel's pruned source for Metal and CUDA; this checks the pruning itself."""

import re

import pytest

from mlx_dsv41 import kernels
from mlx_dsv41.kernels.source_text import items, minified, pruned, resolved

HEADER = minified(r"""
#define KX_HAS_FAST 1
#define UNUSED_MACRO(x) ((x) + 1)
#define USED_MACRO(x) \
  (helper(x) * 2)
typedef unsigned int u32;
// a comment { with a brace
struct Pair { u32 a, b; };
struct Unused { u32 a; };
template <int N>
struct Table { float v[N]; };
template <>
struct Table<1> { float v; };
KX_INLINE u32 helper(u32 x) { return x + 1; }
KX_INLINE u32 helper(float x) { return (u32)x; }
KX_INLINE u32 unused_fn(u32 x) {
  const char* s = "}{";
  return x;
}
KX_INLINE Pair operator+(Pair a, Pair b) { Pair r = {a.a + b.a, a.b + b.b}; return r; }
#if KX_HAS_FAST
KX_INLINE u32 fast_or_slow(u32 x) { return x; }
#else
KX_INLINE u32 fast_or_slow(u32 x) { return x * 1; }
#endif
#if defined(SOMETHING_ELSE)
KX_INLINE u32 maybe(u32 x) { return x; }
#endif
constant float COEFFS[2] = {1.0f, 2.0f};
""")


def test_items_split_at_top_level_declarations():
    names = [i.name for i in items(HEADER)]
    assert names == [
        "KX_HAS_FAST", "UNUSED_MACRO", "USED_MACRO", "u32", "Pair", "Unused", "Table", "Table", "helper", "helper",
        "unused_fn", None, None, "fast_or_slow", None, "fast_or_slow", None, None, "maybe", None, "COEFFS",
    ]  # fmt: skip
    assert items(HEADER)[2].text.count("\n") == 1  # the continuation stays with its #define


def test_an_aligned_struct_is_named_by_its_tag():
    header = "template <typename T>\nstruct alignas(16) Eight {\nT v[8];\n};\nstruct alignas(16) Unread {\nint a;\n};\n"
    assert [i.name for i in items(header)] == ["Eight", "Unread"]
    text = pruned(header, "Eight<float> e;")
    assert "struct alignas(16) Eight" in text and "Unread" not in text


def test_pruned_keeps_what_the_body_reaches_and_nothing_else():
    body = "Table<1> t; out[0] = USED_MACRO(2u) + fast_or_slow(3u) + COEFFS[0];"
    text = pruned(resolved(HEADER), body)
    for kept in ("USED_MACRO", "helper(u32", "helper(float", "struct Table {", "struct Table<1>", "COEFFS", "u32;"):
        assert kept in text, kept
    for dropped in ("UNUSED_MACRO", "unused_fn", "struct Unused"):
        assert dropped not in text, dropped
    assert "operator+" in text and "struct Pair" in text  # no plain name: always kept, and what it uses
    assert "x * 1" not in text and "#else" not in text  # the dead branch of a decided #if
    assert "#if defined(SOMETHING_ELSE)" in text  # undecided: left to the compiler


def test_resolved_keeps_undecided_chains_and_drops_decided_ones():
    text = minified("""
#define A 0
#define B 1
#if A
dead_a();
#elif defined(ELSEWHERE)
maybe_elsewhere();
#else
fallback();
#endif
#if A
#if B
dead_nested();
#elif defined(ELSEWHERE)
dead_nested_elsewhere();
#endif
#endif
#if !B
dead_b();
#else
#if A
nested_dead();
#endif
live_b();
#endif
""")
    out = resolved(text)
    assert "dead_a" not in out and "dead_b" not in out and "nested_dead" not in out and "dead_nested" not in out
    assert out.count("#if") == out.count("#endif")
    assert "#if defined(ELSEWHERE)\nmaybe_elsewhere();\n#else\nfallback();\n#endif" in out
    assert "live_b();" in out


@pytest.mark.parametrize("backend_name", ["cuda", "metal"])
def test_every_kernel_header_is_closed_and_smaller(backend_name):
    """Every name the pruned source uses that the full header defines is defined in the pruned one,
    and no kernel's source grew."""
    for k in kernels.load_all().values():
        full = resolved(k.whole_source(backend_name)[0])
        header, body = k.source(backend_name)
        defined_full = {i.name for i in items(full) if i.name}
        defined_kept = {i.name for i in items(header) if i.name}
        used = set(re.findall(r"[A-Za-z_]\w*", header + body))
        assert (used & defined_full) <= defined_kept, (k.name, sorted((used & defined_full) - defined_kept))
        assert len(header) <= len(full), k.name


def test_conditionals_the_backend_decides_are_gone():
    for k in kernels.load_all().values():
        for backend_name in ("cuda", "metal"):
            header, _ = k.source(backend_name)
            assert not re.search(r"#if !?KX_HAS_(MMA_F16|ASYNC_COPY)\b", header), (k.name, backend_name)
