"""The ShareGPT reader, `kvstrata bench make-dataset`, and the seed preset's shape at any --scale (no server)."""

from __future__ import annotations

import json
import random

import pytest

from kvstrata.bench import compare, make_dataset, presets
from kvstrata.bench.workload import load_sharegpt_texts, sharegpt_prompts


class CharTokenizer:
    """One token per character: lengths are easy to check by hand."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def write(tmp_path, data) -> str:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_reader_keeps_the_first_turn_of_conversations_with_two_turns_as_sglang(tmp_path):
    human, gpt = {"from": "human", "value": "first"}, {"from": "gpt", "value": "answer"}
    path = write(tmp_path, [{"id": "a", "conversations": [human, gpt]},
                            {"id": "b", "conversations": [human]},                         # one turn: skipped
                            {"id": "c", "conversation": [{"from": "human", "value": "alt"}, gpt]},
                            "not a conversation",
                            {"id": "d", "conversations": [{"from": "human", "value": ""}, gpt]}])
    assert load_sharegpt_texts(path) == ["first", "alt"]


@pytest.mark.parametrize("data, message", [({"conversations": []}, "expected a ShareGPT JSON list"),
                                           ([{"conversations": [{"from": "human", "value": "x"}]}],
                                            "no conversation with at least two turns")])
def test_reader_names_what_is_wrong_with_a_file(tmp_path, data, message):
    with pytest.raises(ValueError, match=message):
        load_sharegpt_texts(write(tmp_path, data))


def test_prompts_are_repeated_or_truncated_to_the_length_and_reused_when_short():
    prompts = sharegpt_prompts(["abc", "0123456789"], 3, 7, CharTokenizer(), random.Random(0))
    assert sorted(prompts[:2]) == sorted([[ord(c) for c in "abcabca"], [ord(c) for c in "0123456"]])
    assert prompts[2] == prompts[0]   # two texts for three prompts: the first is used again


def test_make_dataset_writes_sharegpt_that_the_reader_reads(tmp_path):
    out = tmp_path / "made.json"
    argv = ["--out", str(out), "--num-conversations", "25", "--turns", "3", "--seed", "7"]
    assert make_dataset.main(argv) == 0
    data = json.loads(out.read_text())
    assert len(data) == 25 and all(len(c["conversations"]) == 3 for c in data)
    assert [t["from"] for t in data[0]["conversations"]] == ["human", "gpt", "human"]
    assert all(t["value"].strip() for c in data for t in c["conversations"])
    texts = load_sharegpt_texts(str(out))
    assert len(texts) == 25 and all(t in " ".join(make_dataset.corpus_sentences(
        open(make_dataset.DEFAULT_CORPUS, encoding="utf-8").read())) for t in texts)
    again = tmp_path / "again.json"
    assert make_dataset.main(["--out", str(again), *argv[2:]]) == 0
    assert again.read_bytes() == out.read_bytes()   # seeded: same flags, same file


def test_make_dataset_refuses_an_empty_or_missing_corpus(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    assert make_dataset.main(["--out", str(tmp_path / "x.json"), "--corpus", str(empty)]) == 2
    assert make_dataset.main(["--out", str(tmp_path / "x.json"), "--corpus", str(tmp_path / "no.txt")]) == 2
    assert "no sentences" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_the_seed_preset_at_scale_1_is_the_seeds_workload_in_its_proportions():
    shape = presets.seed_shape(1.0, 16)
    assert (shape.num_clients, shape.request_length, shape.longest_prompt) == (150, 2048, 20489)
    assert shape.working_set_tokens == 150 * 20489
    assert shape.device_tokens % 16 == 0
    assert shape.device_tokens / shape.working_set_tokens == pytest.approx(0.35, abs=0.001)
    host = shape.hicache_ratio * shape.device_tokens
    assert host / shape.working_set_tokens == pytest.approx(0.7, abs=0.01)


def test_a_smaller_scale_keeps_the_shape_and_room_for_the_parallel_requests():
    shape = presets.seed_shape(0.05, 16)
    assert (shape.num_clients, shape.request_length) == (8, 102)
    assert presets.seed_shape(0.01, 16).num_clients == 5          # max parallel + 1
    assert shape.longest_prompt == 102 + 9 * 103
    assert shape.device_tokens >= 4 * (shape.longest_prompt + 1)   # the 4 requests in flight
    assert shape.hicache_ratio >= presets.MIN_HOST_RATIO
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="--scale"):
            presets.seed_shape(bad, 16)


def test_compare_preset_fills_the_seed_flags_and_explicit_flags_win():
    argv = ["--preset", "seed", "--scale", "0.1", "--max-parallel", "2", "--configs", "l1,l3"]
    args, extra = compare.build_parser().parse_known_args(argv)
    compare.apply_preset(args, argv)
    assert (args.num_rounds, args.output_length, args.request_rate) == (10, 1, 16.0)
    assert args.ready_queue_policy == "random" and args.enable_round_barrier and args.disable_random_sample
    assert (args.num_clients, args.request_length, args.model_path) == (15, 205, "bench-32k")
    assert args.max_parallel == 2 and args.configs == "l1,l3"
    assert args.device_tokens == args.preset_shape.device_tokens
    args, _ = compare.build_parser().parse_known_args(["--scale", "0.5"])
    with pytest.raises(SystemExit, match="--scale needs --preset"):
        compare.apply_preset(args, ["--scale", "0.5"])


@pytest.mark.parametrize("kv_flags", [["--kv-cache-dtype", "fp8_e4m3"], ["--kv-cache-dtype=fp8_e5m2"]])
def test_compare_preset_sizes_the_mooncake_segment_for_an_fp8_kv_cache(kv_flags):
    base = ["--preset", "seed", "--scale", "0.5"]
    sizes = []
    for argv in (base, base + kv_flags):
        args, _ = compare.build_parser().parse_known_args(argv)
        compare.apply_preset(args, argv)
        sizes.append(args.mooncake_segment_mb)
    assert sizes[1] == pytest.approx(sizes[0] / 2, abs=1)
