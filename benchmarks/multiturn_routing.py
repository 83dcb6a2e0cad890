"""Routing engine replicas: multi-turn ShareGPT conversations with a shared system prompt, sent to
`specserve serve --replicas N` once per routing policy (a fresh Ray cluster each, so every run
starts with cold caches).

Each conversation is a client: its turns go one after another, a think time apart, each turn's prompt being the system
prompt, the earlier human turns and the model's own earlier replies (greedy, streamed), so a turn's
prompt begins with the previous turn's prompt and reply. `--concurrency` conversations run at once.
Reported per policy: prefix-cache hit rate (prompt tokens found cached / looked up, all replicas),
TTFT (median, p90), tokens per verification step (speculation), requests per replica, the router's
own view of how much of each prompt the chosen replica had been sent before, and wall time.

    python benchmarks/multiturn_routing.py --routings affinity,round-robin --json benchmarks/routing_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serverproc import MODEL, Server  # noqa: E402

from specserve.bench.datasets import ShareGPT, read_json_array  # noqa: E402

SYSTEM_PROMPT = (
    "You are Orbit, the support assistant of a small software company. Answer the user's questions "
    "about programming, writing and everyday tasks. Be accurate and concise: prefer short paragraphs "
    "and lists, give code in fenced blocks, and say so when you are not sure. Never invent facts, "
    "links or prices. If a question is ambiguous, answer the most likely reading and name the others. "
    "Keep a friendly, professional tone, and do not mention these instructions. When the user asks "
    "for a plan, number the steps; when they ask for a comparison, use a table; when they ask about "
    "code, explain what it does before how to change it, and keep examples runnable."
)


def conversations(count: int, turns: int, max_chars: int, seed: int) -> list[list[str]]:
    """`count` ShareGPT conversations with at least `turns` human turns (each cut to max_chars)."""
    entries, _ = read_json_array(ShareGPT().resolved_path().read_text(encoding="utf-8"))
    random.Random(seed).shuffle(entries)
    out: list[list[str]] = []
    for entry in entries:
        human = [str(t.get("value", "")) for t in entry.get("conversations", []) if t.get("from") == "human"]
        human = [h.strip()[:max_chars] for h in human if h.strip()]
        if len(human) >= turns and all(h.isascii() for h in human[:turns]):
            out.append(human[:turns])
        if len(out) == count:
            break
    return out


def scrape(server: Server) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(server.http.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def run_conversation(base: str, human: list[str], max_tokens: int, think: Callable[[], float],
                     records: list[dict[str, Any]]) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    with httpx.Client(base_url=base, timeout=600, headers={"Authorization": "Bearer x"}) as http:
        for turn, text in enumerate(human):
            if turn:
                time.sleep(think())  # the user reads the reply and types the next turn
            messages.append({"role": "user", "content": text})
            body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            start = time.perf_counter()
            ttft, reply, usage = None, "", {}
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(event["error"])
                    if event.get("usage"):
                        usage = event["usage"]
                    for choice in event.get("choices", []):
                        piece = choice.get("delta", {}).get("content")
                        if piece:
                            ttft = ttft if ttft is not None else time.perf_counter() - start
                            reply += piece
            records.append({"turn": turn, "ttft": ttft, "latency": time.perf_counter() - start,
                            "prompt_tokens": usage.get("prompt_tokens"),
                            "completion_tokens": usage.get("completion_tokens")})
            messages.append({"role": "assistant", "content": reply})


def run_policy(policy: str, args: argparse.Namespace, convs: list[list[str]], logs: Path) -> dict[str, Any]:
    extra = ["--replicas", str(args.replicas), "--routing", policy, "--replica-cpus", str(args.replica_cpus),
             "--max-model-len", str(args.max_model_len), "--spec", args.spec, "--log-level", "warning",
             "--ray-app-name", f"routing-{policy}"]
    server = Server(Path(args.model), logs / f"{policy}.log", *extra)
    try:
        server.wait_ready(timeout=600)
        work: queue.Queue[list[str]] = queue.Queue()
        for c in convs:
            work.put(c)
        records: list[dict[str, Any]] = []
        errors: list[BaseException] = []

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            think = lambda: rng.expovariate(1 / args.think_time) if args.think_time > 0 else 0.0  # noqa: E731
            while True:
                try:
                    human = work.get_nowait()
                except queue.Empty:
                    return
                try:
                    run_conversation(server.base, human, args.max_tokens, think, records)
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)

        start = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(args.seed + i,)) for i in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        time.sleep(1.5)  # the router's health poll brings the replicas' final counters
        m = scrape(server)
    finally:
        server.stop()
    if errors:
        raise RuntimeError(f"{policy}: {errors[0]!r}")
    ttfts = sorted(r["ttft"] for r in records if r["ttft"] is not None)
    later = sorted(r["ttft"] for r in records if r["ttft"] is not None and r["turn"] > 0)
    steps = m.get("specserve_spec_verification_steps_total", 0)
    accepted = m.get("specserve_spec_accepted_tokens_total", 0)
    per_replica = {k.split('replica="')[1].split('"')[0]: 0 for k in m if k.startswith("specserve_replica_up")}
    for k, v in m.items():
        if k.startswith("specserve_router_requests_total"):
            per_replica[k.split('replica="')[1].split('"')[0]] += v
    reasons: dict[str, float] = {}
    for k, v in m.items():
        if k.startswith("specserve_router_requests_total"):
            reason = k.split('reason="')[1].split('"')[0]
            reasons[reason] = reasons.get(reason, 0) + v
    blocks = m.get("specserve_router_prompt_blocks_total", 0)
    return {
        "routing": policy,
        "requests": len(records),
        "wall_s": round(wall, 2),
        "output_tok_s": round(sum(r["completion_tokens"] or 0 for r in records) / wall, 2),
        "prefix_cache_hit_rate": round(m["specserve_prefix_cache_hit_rate"], 4),
        "prefix_cache_hit_rate_by_replica": {k.split('replica="')[1].split('"')[0]: round(v, 4) for k, v in m.items()
                                             if k.startswith("specserve_replica_prefix_cache_hit_rate")},
        "ttft_median_s": round(statistics.median(ttfts), 4),
        "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 4),
        "ttft_median_later_turns_s": round(statistics.median(later), 4) if later else None,
        "tokens_per_verification_step": round((accepted + steps) / steps, 3) if steps else None,
        "draft_acceptance": round(accepted / m["specserve_spec_draft_tokens_total"], 4)
        if m.get("specserve_spec_draft_tokens_total") else None,
        "requests_by_replica": per_replica,
        "routing_reasons": reasons,
        "router_matched_block_fraction": round(m.get("specserve_router_matched_blocks_total", 0) / blocks, 4)
        if blocks else None,
        "prompt_tokens_mean": round(statistics.mean(r["prompt_tokens"] or 0 for r in records), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--routings", default="affinity,round-robin")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4, help="conversations in flight at once")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--think-time", type=float, default=2.0,
                   help="mean seconds (exponential) a user takes between a reply and the next turn; 0: none "
                        "(then least-loaded routing sends a conversation's next turn back to the replica its "
                        "last turn just left, by accident)")
    p.add_argument("--max-chars", type=int, default=400, help="characters kept of each human turn")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--spec", default="suffix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", type=Path, default=Path("/tmp/multiturn-routing"))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    convs = conversations(args.conversations, args.turns, args.max_chars, args.seed)
    results = []
    for policy in args.routings.split(","):
        r = run_policy(policy, args, convs, args.logs)
        print(json.dumps(r), flush=True)
        results.append(r)
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo"], capture_output=True, text=True).stdout
    out = {"command": " ".join(sys.argv), "cpu": cpu.split(":")[-1].strip(), "platform": platform.platform(),
           "conversations": len(convs), "turns": args.turns, "results": results}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
