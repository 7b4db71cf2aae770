"""lm-evaluation-harness 0.4.13, unchanged, against `b12x serve` of the shipped model.

lm-eval runs from its own venv (tests/clients/venvs.py) as users run it: `lm_eval --model
local-completions --model_args base_url=<server>/v1/completions,model=<name>`, nothing
more. Its defaults are what is under test: `tokenizer_backend` "auto" probes the server's
GET /tokenizer_info and POST /tokenize and then tokenizes through the server (POST
/tokenize, /detokenize); `tokenized_requests` (true) sends every prompt as a batch of
token-id lists; generate_until reads each choice's `text`; loglikelihood sends the context
and continuation ids with `echo: true, logprobs: 1, max_tokens: 1` and sums
`choices[].logprobs.token_logprobs[ctxlen:-1]`.

Two tasks, written here as local YAML over local JSON files (HF_HUB_OFFLINE and
HF_DATASETS_OFFLINE: nothing is downloaded): greedy continuations of Python code cut at stop
strings, and a multiple-choice (loglikelihood) task. The answers are checked against the
offline engine: the same greedy answers for the same prompt ids, and per-choice
log-likelihoods equal to a fresh prefill's log-softmax sums, with the accuracy they imply.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter

import pytest
import yaml

from b12x_toolchain.runtime import load
from clients.serving import assert_text_is_greedy, continuation_logprob, greedy_states
from clients.venvs import CLIENT_ENV, client_venv

pytestmark = [pytest.mark.slow(minutes=0.6), pytest.mark.exports, pytest.mark.usefixtures("one_torch_thread")]

RUN_TIMEOUT_S = 300

GENERATE = [  # Python the shipped model continues: some answers end at a stop string, one at eos, some at length
    "import os\nimport sys\n\n\ndef main():\n",
    'class Error(Exception):\n    """Base class for exceptions in this module."""\n',
    "    def __repr__(self):\n        return",
    '    def close(self):\n        """Close the file."""\n',
    "__all__ = [",
    "    for line in lines:\n",
]
UNTIL = ["\n\n", ":\n"]
MAX_GEN_TOKS = 24

CHOICES = [  # context, choices, the index of the right one
    ("import os\nimport", ["sys", "banana", "while"], 0),
    ('class Error(Exception):\n    """Base class for', ["exceptions", "elephants", "]]"], 0),
    ("if __name__ ==", ["'__main__':", "None:", "+ 1"], 0),
    ("    def __init__(self, path):\n        self.path =", ["path", "return", "import"], 0),
    ("for i in", ["range(n):", "def", "class"], 0),
    ("    except", ["KeyError:", "else", "lambda"], 0),
]


def write_tasks(folder, data) -> None:
    """Two lm-eval task YAMLs in `folder`, over JSON-lines files in `data`."""
    (data / "generate.jsonl").write_text("".join(json.dumps({"prompt": p, "target": ""}) + "\n" for p in GENERATE))
    (data / "choice.jsonl").write_text("".join(json.dumps({"context": c, "choices": o, "label": k}) + "\n"
                                               for c, o, k in CHOICES))
    common = {"dataset_path": "json", "test_split": "test"}
    tasks = {
        "b12x_code_continue": {
            **common, "dataset_kwargs": {"data_files": {"test": str(data / "generate.jsonl")}},
            "output_type": "generate_until", "doc_to_text": "prompt", "doc_to_target": "target",
            "generation_kwargs": {"until": UNTIL, "do_sample": False, "temperature": 0.0,
                                  "max_gen_toks": MAX_GEN_TOKS},
            "metric_list": [{"metric": "exact_match"}],
        },
        "b12x_code_choice": {
            **common, "dataset_kwargs": {"data_files": {"test": str(data / "choice.jsonl")}},
            "output_type": "multiple_choice", "doc_to_text": "context", "doc_to_choice": "choices",
            "doc_to_target": "label", "metric_list": [{"metric": "acc"}],
        },
    }
    for name, task in tasks.items():
        (folder / f"{name}.yaml").write_text(yaml.safe_dump({"task": name, **task}, sort_keys=False))


@pytest.fixture(scope="module")
def package(shipped_path):
    return load(shipped_path)


@pytest.fixture(scope="module")
def evaluation(served, tmp_path_factory):
    """lm-eval's run over both tasks: its results and logged samples, by task."""
    server, recorder = served
    venv = client_venv("lm-eval")
    root = tmp_path_factory.mktemp("lm-eval")
    tasks, data, out, home = (root / name for name in ("tasks", "data", "out", "hf-home"))
    for folder in (tasks, data, out, home):
        folder.mkdir()
    write_tasks(tasks, data)
    env = {**os.environ, **CLIENT_ENV, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(home),
           "TOKENIZERS_PARALLELISM": "false", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    command = [venv / "bin" / "lm_eval", "--model", "local-completions",
               "--model_args", f"base_url={server.url}/v1/completions,model={server.service.model_name}",
               "--tasks", ",".join(sorted(p.stem for p in tasks.glob("*.yaml"))), "--include_path", tasks,
               "--log_samples", "--output_path", out]
    run = subprocess.run([str(c) for c in command], capture_output=True, text=True, env=env, cwd=root,
                         timeout=RUN_TIMEOUT_S)
    refused = "\n".join(map(str, recorder.failures()))
    assert run.returncode == 0, (f"lm_eval exited {run.returncode}; the server refused:\n{refused}\n"
                                 f"--- lm_eval's stderr\n{run.stderr[-5000:]}")
    (results,) = out.rglob("results_*.json")
    samples = {}
    for path in out.rglob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = sorted((json.loads(line) for line in path.read_text().splitlines()),
                               key=lambda s: s["doc_id"])
    return json.loads(results.read_text()), samples


def test_every_request_succeeded(served, evaluation):
    _, recorder = served
    failures = recorder.failures()
    assert not failures, "\n".join(map(str, failures))
    # The default tokenizer backend found the server's tokenizer routes and tokenized through them.
    assert recorder.to("/tokenizer_info", "GET") and recorder.to("/tokenize")
    completions = recorder.to("/v1/completions")
    assert len(completions) == len(GENERATE) + sum(len(o) for _, o, _ in CHOICES)  # batch size 1
    print("lm-eval's requests:", Counter(f"{e.method} {e.path}" for e in recorder.exchanges))
    print("one body of each kind:", recorder.to("/tokenize")[0].body.decode(), completions[0].body.decode(),
          completions[-1].body.decode(), sep="\n")


def test_generate_until_answers_are_the_engines(served, evaluation, package):
    server, recorder = served
    _, samples = evaluation
    docs = samples["b12x_code_continue"]
    assert [d["doc"]["prompt"] for d in docs] == GENERATE
    codec = package.tokenizer
    stops = UNTIL + [codec.decode([codec.eos_id])]  # lm-eval adds the eos token's text it got from /tokenizer_info
    prompts = [codec.encode(d["arguments"]["gen_args_0"]["arg_0"]) for d in docs]
    sent = [e.json()["prompt"] for e in recorder.to("/v1/completions") if "echo" not in e.json()]
    assert sorted(sent) == sorted([p] for p in prompts)  # each prompt went as token ids, a batch of one
    states = greedy_states(package, server.service.session.slots, prompts, MAX_GEN_TOKS, (codec.eos_id,))
    for doc, state in zip(docs, states):
        (answer,) = doc["resps"][0]
        assert_text_is_greedy(answer, state, codec, stops, f"doc {doc['doc_id']}")


def test_choice_loglikelihoods_and_accuracy_are_a_fresh_prefills(served, evaluation, package):
    _, recorder = served
    results, samples = evaluation
    docs = samples["b12x_code_choice"]
    codec, session = package.tokenizer, package.session(slots=1, passes=("prefill",))
    correct, scored = [], []
    for doc in docs:
        offline = []
        for args, resp in zip(doc["arguments"].values(), doc["resps"]):
            context, continuation = args["arg_0"], args["arg_1"]
            # lm-eval's split (TemplateLM._encode_pair): the continuation's ids are the whole
            # text's after the context's, the context's trailing spaces moved to the continuation.
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole, head = codec.encode(context + continuation), codec.encode(context)
            scored.append(whole)
            offline.append(continuation_logprob(session, head, whole[len(head):]))
            got = float(resp[0][0])  # the samples log keeps lm-eval's (loglikelihood, is_greedy) as text
            assert got == pytest.approx(offline[-1], abs=1e-5), f"doc {doc['doc_id']}: {context!r} + {continuation!r}"
        correct.append(max(range(len(offline)), key=offline.__getitem__) == doc["doc"]["label"])
    sent = [e.json()["prompt"] for e in recorder.to("/v1/completions") if e.json().get("echo")]
    assert sorted(sent) == sorted([ids] for ids in scored)  # context and continuation ids, a batch of one
    assert results["results"]["b12x_code_choice"]["acc,none"] == pytest.approx(sum(correct) / len(correct))
