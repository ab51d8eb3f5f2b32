"""tools.sz counts code lines (not blanks or comments) and tokens."""

from tools.sz import measure


def test_measure_counts_code_lines_and_tokens():
    source = "# a comment\n\nx = 1  # trailing\n\ndef f(a):\n    return a + x\n"
    lines, tokens = measure(source)
    assert lines == 3  # x = 1, def f(a):, return a + x
    assert tokens == 3 + 6 + 4  # x = 1 | def f ( a ) : | return a + x
