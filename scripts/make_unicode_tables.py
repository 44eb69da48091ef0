#!/usr/bin/env python3
"""Regenerates the Unicode tables inside infer.hpp (the block between the GENERATED markers in section 3).

The tokenizer's regex needs general categories (\\p{L}, \\p{N}, ...) and White_Space (\\s); Qwen's NFC normalizer needs
canonical combining classes, canonical decompositions and which of them recompose. Everything comes from Python's
own `unicodedata` (standard library), so the tables follow the Unicode version of the Python that runs this:

    python3 scripts/make_unicode_tables.py            # rewrites ../infer.hpp in place
"""
import pathlib
import sys
import unicodedata

HEADER = pathlib.Path(__file__).resolve().parent.parent / "infer.hpp"
BEGIN = "// ---- BEGIN GENERATED UNICODE TABLES"
END = "// ---- END GENERATED UNICODE TABLES"
MAX = 0x110000

# White_Space (PropList.txt); unicodedata has no accessor for it, and the list has not changed since Unicode 6.
WHITE_SPACE = [0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680] + list(range(0x2000, 0x200B)) + \
              [0x2028, 0x2029, 0x202F, 0x205F, 0x3000]


def ranges(predicate):
    """[(first, last)] of the code points where predicate holds, consecutive ones merged."""
    out = []
    for cp in range(MAX):
        if predicate(cp):
            if out and out[-1][1] == cp - 1:
                out[-1][1] = cp
            else:
                out.append([cp, cp])
    return out


def category_ranges(prefix):
    return ranges(lambda cp: unicodedata.category(chr(cp)).startswith(prefix))


def emit_pairs(name, pairs, comment):
    lines = [f"// {comment}: {len(pairs)} ranges, first and last code point of each.",
             f"inline constexpr char32_t {name}[][2] = {{"]
    items = [f"{{0x{a:X},0x{b:X}}}" for a, b in pairs]
    for i in range(0, len(items), 10):
        lines.append("    " + ",".join(items[i:i + 10]) + ",")
    lines.append("};")
    return lines


def main():
    out = [f"{BEGIN} (scripts/make_unicode_tables.py, Unicode {unicodedata.unidata_version}; do not edit by hand) ----"]
    out += emit_pairs("letter_ranges", category_ranges("L"), "General category L (Lu Ll Lt Lm Lo): \\p{L}")
    out += emit_pairs("number_ranges", category_ranges("N"), "General category N (Nd Nl No): \\p{N}")
    out += emit_pairs("mark_ranges", category_ranges("M"), "General category M (Mn Mc Me): \\p{M}")
    out += emit_pairs("punctuation_ranges", category_ranges("P"), "General category P: \\p{P}")
    out += emit_pairs("white_space_ranges", ranges(lambda cp: cp in WHITE_SPACE), "White_Space: \\s")

    # Canonical combining classes, as runs of equal non-zero class: {first, last, class}.
    runs = []
    for cp in range(MAX):
        ccc = unicodedata.combining(chr(cp))
        if ccc:
            if runs and runs[-1][1] == cp - 1 and runs[-1][2] == ccc:
                runs[-1][1] = cp
            else:
                runs.append([cp, cp, ccc])
    out.append(f"// Canonical combining class (non-zero only): {len(runs)} runs of {{first, last, class}}.")
    out.append("inline constexpr char32_t combining_class_runs[][3] = {")
    items = [f"{{0x{a:X},0x{b:X},{c}}}" for a, b, c in runs]
    for i in range(0, len(items), 8):
        out.append("    " + ",".join(items[i:i + 8]) + ",")
    out.append("};")

    # Canonical decompositions (one level; Hangul syllables are computed, not listed). A decomposition cannot be a
    # range, so this one table is per code point: {code point | 0x80000000 when NFC recomposes it, first, second or 0}.
    decompositions = []
    for cp in range(MAX):
        if 0xAC00 <= cp <= 0xD7A3:
            continue
        d = unicodedata.decomposition(chr(cp))
        if not d or d.startswith("<"):
            continue
        parts = [int(x, 16) for x in d.split()]
        composes = len(parts) == 2 and unicodedata.normalize("NFC", chr(cp)) == chr(cp)
        decompositions.append((cp | (0x80000000 if composes else 0), parts[0], parts[1] if len(parts) > 1 else 0))
    out.append(f"// Canonical decompositions: {len(decompositions)} entries of {{code point (| 0x80000000 when NFC "
               "recomposes it), first, second (0: a singleton)}}, sorted by code point.")
    out.append("inline constexpr char32_t canonical_decompositions[][3] = {")
    items = [f"{{0x{a:X},0x{b:X},0x{c:X}}}" for a, b, c in decompositions]
    for i in range(0, len(items), 6):
        out.append("    " + ",".join(items[i:i + 6]) + ",")
    out.append("};")

    # Simple case folding onto ASCII letters from outside ASCII (what (?i:'s|'t|...) needs: U+017F ſ is an s).
    folds = [(cp, ord(chr(cp).casefold())) for cp in range(128, MAX)
             if len(chr(cp).casefold()) == 1 and chr(cp).casefold().isascii() and chr(cp).casefold().isalpha()]
    out.append("// Non-ASCII code points whose case folding is an ASCII letter: {code point, folded}.")
    out.append("inline constexpr char32_t ascii_case_folds[][2] = {" +
               ",".join(f"{{0x{a:X},0x{b:X}}}" for a, b in folds) + "};")
    out.append(END + " ----")

    text = HEADER.read_text()
    begin = text.index(BEGIN)
    end = text.index("\n", text.index(END)) + 1
    HEADER.write_text(text[:begin] + "\n".join(out) + "\n" + text[end:])
    print(f"wrote {len(out)} lines of tables into {HEADER}", file=sys.stderr)


if __name__ == "__main__":
    main()
