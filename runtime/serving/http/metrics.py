"""The server's Prometheus metrics, in a registry of its own (two servers in one process never mix).

Counters a client can check against its responses: requests by outcome (the finish reason
of every request the engine took: stop, length, cancelled), refusals by HTTP status,
prompt and generated tokens. Latency: time to first token from the request's arrival,
and the gap between tokens (a step that emits k tokens counts its gap k times, over k).
The engine: queue depth, running requests, drafted and accepted tokens, row-steps that
stepped aside from drafting (draft_policy.py), tokens per row-step, prefix-cache hits by tier and the prompt tokens they restored, pages in use; for a
parallel package, each rank's pages in use and replay time under a `rank` label.

The same speculation counts also go out under the names vLLM gives them (`vllm:spec_decode_*`,
scraped by `vllm bench serve` and dashboards made for vLLM): a draft is one row-step that
verified drafts, and per position i, how many of those accepted more than i drafts.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STEP_TOKEN_BUCKETS = tuple(float(n) for n in range(1, 10))


class ServerMetrics:
    def __init__(self):
        registry = self.registry = CollectorRegistry()
        self.requests = Counter("b12x_requests", "Requests the engine ran, by outcome (finish reason)", ["outcome"],
                                registry=registry)
        self.refused = Counter("b12x_refused_requests", "Requests answered with an error, by HTTP status", ["status"],
                               registry=registry)
        self.prompt_tokens = Counter("b12x_prompt_tokens", "Prompt tokens of requests the engine ran", registry=registry)
        self.generated_tokens = Counter("b12x_generation_tokens", "Tokens generated", registry=registry)
        self.ttft = Histogram("b12x_time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("b12x_inter_token_latency_seconds", "Time between a request's tokens",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.queue_depth = Gauge("b12x_queue_depth", "Requests waiting for a slot", registry=registry)
        self.running = Gauge("b12x_running_requests", "Requests holding a slot", registry=registry)
        self.drafted = Counter("b12x_drafted_tokens", "Draft tokens proposed", registry=registry)
        self.accepted = Counter("b12x_accepted_tokens", "Draft tokens the target accepted", registry=registry)
        self.aside = Counter("b12x_draft_aside_row_steps", "Row-steps of greedy requests decoded without drafting, "
                             "while their drafts were not accepted often enough to pay", registry=registry)
        self.tokens_per_step = Histogram("b12x_tokens_per_step", "Tokens emitted per request per decoding step, "
                                         "averaged over each engine step", buckets=STEP_TOKEN_BUCKETS,
                                         registry=registry)
        self.prefix_hits = Counter("b12x_prefix_hits", "Prompts that a prefix snapshot started, by tier", ["tier"],
                                   registry=registry)
        self.cached_tokens = Counter("b12x_prefix_cached_tokens", "Prompt tokens restored from prefix snapshots",
                                     registry=registry)
        self.pages_in_use = Gauge("b12x_pages_in_use", "Cache pages held by slots or snapshots", ["pool"],
                                  registry=registry)
        self.pages = Gauge("b12x_pages", "Cache pages of each pool", ["pool"], registry=registry)
        # A parallel package's ranks, each its own (rank 0's scheduler decides for all of them).
        self.rank_pages_in_use = Gauge("b12x_rank_pages_in_use", "Cache pages in use on each rank", ["rank", "pool"],
                                       registry=registry)
        self.rank_replay_seconds = Gauge("b12x_rank_replay_seconds", "Seconds each rank has spent replaying passes",
                                         ["rank"], registry=registry)
        self.control_seconds = Gauge("b12x_control_seconds", "Seconds rank 0 spent sending step messages to the "
                                     "other ranks and hearing back", registry=registry)
        self.control_messages = Gauge("b12x_control_messages", "Step messages rank 0 sent to the other ranks",
                                      registry=registry)
        self.compiled_buckets = Gauge("b12x_compiled_buckets", "(pass, rows bucket) graphs compiled by TorchInductor "
                                      "so far, of b12x_compile_buckets", registry=registry)
        self.compile_buckets = Gauge("b12x_compile_buckets", "(pass, rows bucket) graphs to compile; 0: compiled "
                                     "replay is off", registry=registry)
        self.compiled_replay = Gauge("b12x_compiled_replay", "1 once the engine replays its compiled graphs "
                                     "(all switched at once, between requests), else 0", registry=registry)
        self.compile_failed = Gauge("b12x_compile_failed", "1 when a compilation failed and the plain graphs "
                                    "stay", registry=registry)
        self.step_seconds = Histogram("b12x_step_seconds", "Engine steps that ran requests: their prefill and decode "
                                      "time", buckets=LATENCY_BUCKETS, registry=registry)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Row-steps that verified drafts",
                                   registry=registry)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed",
                                         registry=registry)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                     registry=registry)
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Row-steps that accepted the draft at each position", ["position"],
                                             registry=registry)

    def record_step(self, step) -> None:
        """One engine step's StepStats (serving/stats.py)."""
        self.drafted.inc(step.drafted)
        self.accepted.inc(step.accepted)
        self.aside.inc(step.aside_rows)
        lengths = step.accepted_lengths if step.drafted else []
        self.spec_drafts.inc(len(lengths))
        self.spec_draft_tokens.inc(step.drafted)
        self.spec_accepted.inc(step.accepted)
        for position in range(max(lengths, default=0)):
            self.spec_accepted_per_pos.labels(str(position)).inc(sum(n > position for n in lengths))
        if step.rows:
            self.tokens_per_step.observe(step.derived()["tokens_per_step"])
        self.step_seconds.observe(step.prefill_seconds + step.decode_seconds)

    def record_pages(self, pools: dict) -> None:
        """Each pool's PoolStats (session/pages.py), by pool name."""
        for pool, stats in pools.items():
            self.pages_in_use.labels(pool).set(stats.in_use)
            self.pages.labels(pool).set(stats.pages)

    def record_compile(self, compiler) -> None:
        """The session's background compilation (session/background_compile.py), or None without one."""
        status = compiler.status() if compiler is not None else {"buckets": 0, "compiled": 0, "state": "off"}
        self.compile_buckets.set(status["buckets"])
        self.compiled_buckets.set(status["compiled"])
        self.compiled_replay.set(status["state"] == "compiled")
        self.compile_failed.set(status["state"] == "failed")

    def record_ranks(self, session) -> None:
        """A parallel package's: each rank's last report and rank 0's control time (runtime/parallel/
        lockstep.py's LeaderSession); nothing for one device's session."""
        reports = getattr(session, "rank_reports", None)
        if reports is None:
            return
        self.control_seconds.set(session.control_seconds)
        self.control_messages.set(session.control_messages)
        for rank, report in enumerate(reports):
            self.rank_replay_seconds.labels(str(rank)).set(report["replay_seconds"])
            for pool, in_use in report["pages_in_use"].items():
                self.rank_pages_in_use.labels(str(rank), pool).set(in_use)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
