"""The closed loop's measuring phases: every arm served with EAGLE-3 and measured by ``hs-extract accept``
(loop/serving.py runs the jobs side by side), SpecForge's own benchmark beside it, the greedy check."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

from common import Server
from loop import controls, drafters, serving, specbench

ROOT = Path(__file__).resolve().parents[3]


class Measuring:
    # ------------------------------------------------------------------ drafters
    def ready(self, name: str) -> Path:
        """The exported drafter of training ``name`` (waits for the training; exports once)."""
        d = self.work / "train" / name
        if not d.is_dir():
            raise RuntimeError(f"no training {name} (its phase has not run)")
        while not (d / "rc").exists():
            if self.left() < self.a.job_seconds:
                raise RuntimeError(f"training {name} still running with {self.left():.0f}s left")
            time.sleep(3)
        with self._export_lock(name):
            done = self.state.setdefault("exported", {})
            dst = self.work / "drafters" / name
            if done.get(name, {}).get("rc") == 0 and dst.is_dir():
                return dst
            rc = (d / "rc").read_text().strip()
            if rc != "0":
                raise RuntimeError(f"training {name} exited {rc}: " + " | ".join(
                    (d / "train.log").read_text(errors="replace").splitlines()[-5:]))
            shutil.rmtree(dst, ignore_errors=True)
            e = drafters.export(d / "out", name, self.work / "draft.json", dst, self.sf_env())
            if e.get("rc") != 0:
                done[name] = e
                raise RuntimeError(f"specforge export {name}: {e}")
            p = self.hs_extract("drafter-config", "--serve-release", "0.5.16", "--layers", self.a.aux_layers,
                                "--model", str(self.target), "--into", str(dst / "config.json"))
            e["drafter_config"] = {"rc": p.returncode, "err": p.stderr[-300:]}
            e["losses"] = drafters.losses(d / "train.log")
            done[name] = e
            return dst

    def _export_lock(self, name: str) -> threading.Lock:
        with self.lock:
            locks = self.__dict__.setdefault("_locks", {})
            return locks.setdefault(name, threading.Lock())

    # ------------------------------------------------------------------ jobs
    def jobs(self, arms: list[str], setting: str, temperature: float = 0.0, seeds: int | None = None,
             plain: bool = False, tag: str = "") -> list[serving.Job]:
        out = []
        for arm in arms:
            n = seeds if seeds is not None else (self.a.seeds if arm in ("ours", "specforge", "fp8") else
                                                  1 if arm == "untrained" else
                                                  controls.seeds_for(self.a.control_seeds, arm))
            for s in range(n):
                key = f"{arm}-s{s}@{setting}" + (f"@T{temperature:g}" if temperature else "") + tag
                if key in self.state.get("measured", {}):
                    continue
                meta = {"arm": arm, "seed": s, "setting": setting, "temperature": temperature}
                if tag:   # another check's measurement of the same drafter (the greedy check): kept out of the table
                    meta["tag"] = tag.lstrip("@")
                out.append(serving.Job(key, f"{arm}-s{s}", setting, temperature, plain, meta))
        return out

    def run_jobs(self, jobs: list[serving.Job], data: Path | None = None, plain_url: str | None = None,
                 model: Path | None = None, measure=None) -> dict:
        data = data or self.work / "eval.jsonl"
        n = sum(1 for line in data.read_text().splitlines() if line.strip())
        runner = serving.Runner(Server, model or self.target, serving.serve_flags(self.a.kv_tokens, self.a.max_running),
                                self.a.port + 100 + 40 * len(self.state.get("measured", {})), self.a.max_servers,
                                self.a.job_seconds, self.left, self.log)
        mdir = self.work / "measure"
        mdir.mkdir(exist_ok=True)

        def run_one(job: serving.Job, url: str) -> dict:
            if measure is not None:
                return measure(job, url)
            out = mdir / f"{job.key.replace('@', '_').replace(',', '-')}.json"
            return {**serving.measure(url, data, self.target, out, plain_url if job.plain else None, self.a.max_new,
                                      n, ROOT, self.hs_env(), job.temperature), "report": str(out)}

        def record(job: serving.Job, res: dict) -> None:
            with self.lock:
                self.state.setdefault("measured", {})[job.key] = {"meta": job.meta, "report": res.pop("report", ""),
                                                                  "summary": res}
                self.save()

        status = runner.run(jobs, self.ready, run_one, record)
        left = {k: v for k, v in status.items() if v != "done"}
        return {"status": status, **({"_incomplete": True} if left else {})}

    # ------------------------------------------------------------------ phases
    def serve_main(self) -> dict:
        done = self.state["done"]
        # SpecForge's capture and the fp8 arm only where their phases ran (a run may leave either out)
        ran = [k for k in ("specforge", "fp8") if k in done and not done[k].get("failed")]
        arms = ["ours", *ran, *[k for k in self.a.controls.split(",") if k], "untrained"]
        return self.run_jobs(self.jobs(arms, "3,1,4"))

    def serve_long(self) -> dict:
        return self.run_jobs(self.jobs(["ours", "specforge"], "7,1,8"))

    def serve_t1(self) -> dict:
        return self.run_jobs(self.jobs(["ours", "prenorm"], "3,1,4", temperature=1.0, seeds=1))

    def greedy(self) -> dict:
        """ours-s0 at (3,1,4) with --plain: every differing output's first difference judged near-tie or not."""
        plain = Server("plain", str(self.target), self.a.port + 90, 4096, None,
                       serving.serve_flags(self.a.kv_tokens, self.a.max_running), mem_fraction=0.9)
        try:
            plain.wait_ready()
            return self.run_jobs(self.jobs(["ours"], "3,1,4", seeds=1, plain=True, tag="@plain"), plain_url=plain.url)
        finally:
            plain.stop()

    def specbench(self) -> dict:
        """SpecForge's bench_eagle3.py at batch 8 and 1, then hs-extract accept on the same HumanEval prompts and
        server, for ours-s0 and specforge-s0 at (3,1,4) and (7,1,8)."""
        bdir = self.work / "specbench"
        bdir.mkdir(exist_ok=True)
        specbench.layout(self.carry / "bench", bdir)
        link = specbench.link_target(self.target, self.work)
        done = self.state.setdefault("specbench", {})

        def measure(job: serving.Job, url: str) -> dict:
            port = int(url.rsplit(":", 1)[1])
            res: dict = {"rc": 0}
            for batch, blist in ((8, self.a.bench_list), (1, self.a.bench_list_b1)):
                name = f"{job.key.replace('@', '_').replace(',', '-')}_b{batch}"
                r = specbench.run(self.carry / "benchmarks", bdir, link, port, batch, blist, self.bench_env(), name,
                                  max(60, self.left() - 30))
                limit = int(blist.split(":")[1]) if ":" in blist else 164
                out = bdir / f"{name}-accept.json"
                acc = serving.measure(url, self.work / "humaneval_raw.jsonl", self.target, out, None, 1024, batch,
                                      ROOT, self.hs_env(), extra=["--limit", str(limit)])
                res[f"batch{batch}"] = {"specforge_bench": r, "hs_extract_accept": {
                    k: acc.get(k) for k in ("rc", "accept_length", "accept_length_gauge", "measured", "at_cap",
                                            "seconds")}}
                bench = {b: [m.get("accept_length") for m in v] for b, v in (r.get("metrics") or {}).items()}
                res["summary"] = " ".join(filter(None, [res.get("summary"), f"batch {batch}: bench_eagle3.py {bench}, "
                                                        f"hs-extract accept {acc.get('accept_length')};"]))
                with self.lock:  # a copy: this thread goes on adding to res while others save the state
                    done[job.key] = dict(res)
                    self.save()
                if r["rc"] != 0:   # not measured: the same command runs this job again
                    raise RuntimeError(f"SpecForge's bench_eagle3.py exit {r['rc']} at batch {batch}: "
                                       f"{r.get('tail', '')[-400:]}")
            return res

        jobs = [j for s in ("3,1,4", "7,1,8") for j in self.jobs(["ours", "specforge"], s, seeds=1, tag="@bench")]
        return {**self.run_jobs(jobs, model=link, measure=measure), "results": done}
