"""The answers' chunk format: read back whole, or the answers alone for a seed corpus."""

from specserve.data.answers import Answer, answer_outputs, load_answers, load_chunk, save_chunk


def test_a_chunk_reads_back_exactly_what_was_saved(tmp_path):
    saved = [Answer("chat", 3, [1, 2, 3, 9, 8]), Answer("turn", 5, [4, 4, 4, 4, 4, 7]), Answer("code", 1, [0, 65535])]
    save_chunk(tmp_path / "answers-00000.npz", saved)
    save_chunk(tmp_path / "answers-00001.npz", saved[:1])
    assert load_chunk(tmp_path / "answers-00000.npz") == saved
    assert load_answers(tmp_path) == saved + saved[:1]
    assert not list(tmp_path.glob("*.partial*"))
    assert [o.tolist() for o in answer_outputs(tmp_path)] == [[9, 8], [7], [65535], [9, 8]]
