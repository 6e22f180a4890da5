"""``tinyserve generate``: JSON shape, text mode, one-line errors with exit status 2."""

from __future__ import annotations

import json

import pytest

from tinyserve_trt.runtime.cli import main


def test_generate_json(llama, capsys):
    assert main(["generate", str(llama[1]), "--prompt-ids", "5,6,7", "--max-tokens", "6", "--temperature", "0",
                 "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)  # exactly one JSON object
    assert set(out) == {"token_ids", "text", "stats"}
    assert len(out["token_ids"]) == 6 and all(isinstance(t, int) for t in out["token_ids"])
    assert out["stats"]["request"]["prompt_tokens"] == 3 and out["stats"]["engine"]["token_budget"] == 16


def test_generate_dense_text(llama, capsys):
    assert main(["generate", str(llama[1]), "--prompt", "Hi", "--max-tokens", "3", "--dense", "--json",
                 "--seed", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["engine"]["token_budget"] == 0 and isinstance(out["text"], str)


@pytest.mark.parametrize("args, match", [
    (["--prompt-ids", "1,x"], "token ids"),
    (["--prompt-ids", "1", "--temperature", "-1"], "temperature"),
    (["--prompt-ids", "1", "--dense", "--token-budget", "4"], "not allowed"),
    (["--prompt-ids", "1", "--max-tokens", "0"], "max_tokens"),
    (["--prompt-ids", "999"], "token ids must be in"),
    ([], "required"),
])
def test_bad_input_one_line_exit_2(llama, capsys, args, match):
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(["generate", str(llama[1]), *args]))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err


def test_missing_package_exit_2(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nope"), "--prompt-ids", "1"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_generate_hot_fraction_and_no_kv_tiers(llama_cold, capsys):
    prompt = ",".join(str((i * 7 + 1) % 256) for i in range(80))  # 20 pages of 4: room to demote
    common = ["generate", str(llama_cold[1]), "--prompt-ids", prompt, "--max-tokens", "8", "--temperature", "0",
              "--ignore-eos", "--json"]
    assert main([*common, "--hot-fraction", "0.1"]) == 0
    engine = json.loads(capsys.readouterr().out)["stats"]["engine"]
    assert engine["hot_fraction"] == 0.1 and engine["pages_demoted"] > 0 and engine["kv_scales"] == "dynamic"
    assert main([*common, "--hot-fraction", "0.1", "--kv-scales", "static"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["engine"]["kv_scales"] == "static"
    assert main([*common, "--no-kv-tiers"]) == 0
    assert "pages_demoted" not in json.loads(capsys.readouterr().out)["stats"]["engine"]
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main([*common, "--hot-fraction", "2"]))
    assert e.value.code == 2 and "hot_fraction" in capsys.readouterr().err


@pytest.mark.parametrize("args, match", [
    (["--token-budget", "1000000000000"], "token_budget must be <= 2147483647"),  # was a traceback, exit 0
    (["--token-budget", "100000"], "token_budget must be <= 8192"),
    (["--temperature", "inf"], "temperature"),
    (["--top-p", "nan"], "top_p"),
    (["--repetition-penalty", "inf"], "repetition_penalty"),
    (["--max-tokens", "99999999999"], "max_tokens"),
    (["--seed", "-3"], "seed"),
    (["--sparse-min-ratio", "-1"], "sparse_min_ratio"),
    (["--sparse-min-ratio", "nan"], "sparse_min_ratio"),
])
def test_out_of_bounds_flags_one_line_exit_2(llama, capsys, args, match):
    assert main(["generate", str(llama[1]), "--prompt-ids", "1,2", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err and "Traceback" not in err


def test_readme_chat_command_is_greedy_without_a_generation_config(llama, capsys):
    """``tinyserve generate PKG --chat --prompt ...`` (the README's first command) samples
    with the package's defaults: greedy for a package without generation_config.json, so
    it gives the model's most likely answer, every time; explicit flags still override."""
    cmd = ["generate", str(llama[1]), "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "8",
           "--ignore-eos", "--json"]
    runs = []
    for extra in ([], [], ["--temperature", "0"]):
        assert main([*cmd, *extra]) == 0
        runs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 8
    sampled = set()
    for seed in range(4):
        assert main([*cmd, "--temperature", "5", "--seed", str(seed)]) == 0
        sampled.add(tuple(json.loads(capsys.readouterr().out)["token_ids"]))
    assert sampled != {tuple(runs[0])}  # the flag overrides the greedy default


@pytest.mark.parametrize("args, match", [
    (["--max-n", "129"], "max_n must be an int in [1, 128]"),
    (["--max-n", "0"], "max_n"),
    (["--max-batch", "10000000000"], "max_batch must be <= 2147483647"),
    (["--timeout", "nan"], "timeout"),
    (["--token-budget", "1000000000000"], "token_budget"),
    (["--sparse-min-ratio", "inf"], "sparse_min_ratio"),
])
def test_serve_rejects_out_of_bounds_options_before_loading(llama, capsys, args, match):
    assert main(["serve", str(llama[1]), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err


def test_generate_kv_cache_dir_serves_the_prompt_from_disk_on_the_next_run(llama, capsys, tmp_path):
    cmd = ["generate", str(llama[1]), "--prompt-ids", ",".join(str(i) for i in range(3, 40)), "--max-tokens", "4",
           "--temperature", "0", "--ignore-eos", "--json", "--kv-cache-dir", str(tmp_path), "--kv-cache-max-gb", "0.1"]
    assert main(cmd) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["stats"]["engine"]["prefix_pages_disk"] == 0
    assert main(cmd) == 0  # a new process would do the same: the store is the directory
    again = json.loads(capsys.readouterr().out)
    assert again["token_ids"] == first["token_ids"]
    assert again["stats"]["engine"]["prefix_pages_disk"] == 36 // 4
    assert again["stats"]["request"]["ttft"] is not None


@pytest.mark.parametrize("args, match", [
    (["--kv-cache-dir", "d", "--kv-cache-max-gb", "0"], "kv_cache_max_gb"),
    (["--kv-cache-host-gb", "-1"], "kv_cache_host_gb"),
    (["--kv-cache-dir", "d", "--no-prefix-sharing"], "prefix sharing"),
    (["--kv-cache-write-through"], "needs a page store"),
])
def test_kv_cache_flags_one_line_exit_2(llama, capsys, args, match):
    assert main(["generate", str(llama[1]), "--prompt-ids", "1,2", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err
    assert main(["serve", str(llama[1]), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err


def test_serve_replicas_share_the_kv_cache_dir_with_write_through(llama, monkeypatch, tmp_path):
    pytest.importorskip("ray.serve")
    from tinyserve_trt.runtime.server import ray_app

    seen = {}
    monkeypatch.setattr(ray_app, "run", lambda model_dir, config, scale, engine, warmup: seen.update(engine) or 0)
    assert main(["serve", str(llama[1]), "--replicas", "2", "--kv-cache-dir", str(tmp_path)]) == 0
    # every replica gets the same directory and publishes its pages as it computes them
    assert seen["kv_cache_dir"] == str(tmp_path) and seen["kv_cache_write_through"] is True


def test_generate_says_where_the_memory_went(llama, capsys):
    """Weights, the KV pages the run held at most, and the rest (issue #31: peak = weights + KV pages
    + a bounded workspace). 40 prompt tokens + 6 new on 4-token pages: 12 pages at most."""
    import re

    prompt = ",".join(str(5 + i % 200) for i in range(40))
    assert main(["generate", str(llama[1]), "--prompt-ids", prompt, "--max-tokens", "6", "--ignore-eos",
                 "--temperature", "0"]) == 0
    line = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[memory:"))
    m = re.search(r"KV pages [\d.]+ \((\d+) of (\d+) pages\)", line)
    assert m and int(m.group(1)) == 12 and int(m.group(2)) >= 12, line
    assert "weights" in line and "workspace" in line
