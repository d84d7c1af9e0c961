#!/usr/bin/env python3
"""The closed loop on one GPU: train a target, extract its states with the product, train EAGLE-3
drafters with SpecForge's own trainer on ours and on the compared pipelines' features, serve each
with SGLang's EAGLE-3 beside the target, and measure what it accepts on held-out chats.

Phases (each records its results; a phase already done is skipped, so the same command resumes
on the same machine, and a call stops starting phases when fewer than its estimate of seconds is
left before --deadline):

  corpus     chats cut from the installed Python packages' sources (train / held-out by file)
  target     its own BPE tokenizer and ChatML template, a DeepseekV3 (MLA + MoE) trained from
             scratch for --target-seconds
  extract    the patched SGLang 0.5.16 server with capture on: the target's own greedy answers to
             the drafter-training chats (requests prefixed nocap-, not captured), then
             `hs-extract drive` over those chats (default capture), `hs-extract export --format
             specforge`, `hs-extract drafter-config`
  variants   transformers states (hf), aux planes one layer late (late), the pre-norm final state
             as SpecForge's teacher (prenorm)
  launch     `specforge train` for every variant but SpecForge's own (in the background: they go on
             across calls while the machine stays)
  specforge  SpecForge's own prepare_hidden_states.py (its repository) under SGLang 0.5.14 (its pin), batch
             size 1, then its drafter's training
  drafters   wait for every training, `specforge export --to sglang`, the eagle_config from
             `hs-extract drafter-config --into`, the teachers' argmax agreement with ours
  serve      every drafter at each --settings (steps,topk,tokens) and a plain server, all at once;
             `hs-extract accept` against each with the plain server as greedy reference
  table      the results table (markdown) in --out

usage (on the GPU machine, after `source .gpukit/device_setup.sh`):
  python3 tests/gpu/closed_loop.py --work /tmp/loop --out "$OUT/loop" --deadline 560
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE.parent), str(HERE)]

from common import REC, Server, hs_patch_cli  # noqa: E402
from loop import corpus, drafters, features, serving, target  # noqa: E402
from loop.specforge import build_site514, prepare_args  # noqa: E402

PHASES = ("corpus", "target", "extract", "launch", "variants", "launch_variants", "specforge", "drafters", "serve",
          "table")
ESTIMATE_S = {"corpus": 45, "target": 60, "extract": 220, "launch": 15, "variants": 100, "launch_variants": 10,
              "specforge": 300, "drafters": 90, "serve": 280, "table": 5}
VARIANTS = ("hf", "late", "prenorm", "untrained")


class Loop:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.work = Path(a.work)
        self.out = Path(a.out)
        self.state_path = self.work / "state.json"
        self.state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {"done": {}}
        self.t_end = time.time() + a.deadline
        self.target = self.work / "target"
        self.carry = Path(a.carry)
        self.shm = Path(a.shm)

    # ------------------------------------------------------------------ bookkeeping
    def log(self, *msg: object) -> None:
        REC.log(*msg)

    def save(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1, default=str))
        os.replace(tmp, self.state_path)
        (self.out / "results.json").write_text(json.dumps(self.state, indent=1, default=str))

    def left(self) -> float:
        return self.t_end - time.time()

    def sf_env(self, site: str | None = None) -> dict[str, str]:
        """SpecForge's processes: its own --target dir (and SGLang 0.5.14 for its capture), never the
        0.5.16 kit's transformers."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = ":".join(p for p in (str(self.work / "sfsite"), site) if p)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def hs_env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}

    def hs_extract(self, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hs_patch.host.extract_cli", *args], cwd=ROOT,
                              env=self.hs_env(), capture_output=True, text=True, timeout=timeout)

    # ------------------------------------------------------------------ phases
    def corpus(self) -> dict:
        import site

        roots = corpus.package_roots(site.getsitepackages() + [site.getusersitepackages()])
        train, held = corpus.build(roots, workers=min(16, os.cpu_count() or 2))
        n_d, n_h = self.a.drafter_chats, self.a.heldout
        if len(train) < n_d + 1000 or len(held) < n_h:
            raise RuntimeError(f"only {len(train)} train / {len(held)} held-out chats in {roots}")
        # the drafter's prompts: an even slice of the training split (the held-out split is never trained on)
        step = max(1, len(train) // n_d)
        corpus.write_jsonl(self.work / "target_chats.jsonl", train[:: max(1, len(train) // self.a.target_chats)])
        corpus.write_jsonl(self.work / "drafter_prompts.jsonl", train[::step][:n_d])
        corpus.write_jsonl(self.work / "heldout.jsonl", held[:: max(1, len(held) // n_h)][:n_h])
        return {"roots": [str(r) for r in roots], "train_chats": len(train), "heldout_chats": len(held),
                "drafter_chats": n_d, "heldout_used": n_h}

    def target_phase(self) -> dict:
        chats = corpus.read_jsonl(self.work / "target_chats.jsonl")
        texts = [target.render(c) for c in chats]
        self.target.mkdir(parents=True, exist_ok=True)
        tok = target.train_tokenizer(texts[:: max(1, len(texts) // 20000)], self.a.vocab, self.target)
        eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
        cfg = target.config(len(tok), hidden=self.a.hidden, layers=self.a.layers, eos_id=eos, pad_id=pad)
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        blocks = target.packed_blocks(ids, self.a.block, self.a.seed)
        model, stats = target.train(cfg, blocks, seconds=self.a.target_seconds, batch=self.a.batch, lr=self.a.lr,
                                    seed=self.a.seed, device=self.a.device, log=self.log)
        target.save(model, tok, self.target)
        del model
        return {**stats, "vocab": len(tok), "blocks": len(blocks), "block_tokens": self.a.block}

    def extract(self) -> dict:
        import requests

        st = hs_patch_cli("apply", "--site", self.a.site)
        assert st["exit_code"] == 0 and st["state"] == "patched", st
        cap, samples = self.shm / "loop-capture", self.shm / "loop-samples"
        for d in (cap, samples, self.work / "drive-state"):
            shutil.rmtree(d, ignore_errors=True)
        capture = {"HS_CAPTURE": "1", "HS_CAPTURE_DIR": str(cap)}
        if self.a.capture_layers:
            capture["HS_CAPTURE_LAYERS"] = self.a.capture_layers
        server = Server("capture", str(self.target), self.a.port, 4096, capture,
                        ["--context-length", "4096", "--mem-fraction-static", "0.5"])
        res: dict = {}
        try:
            server.wait_ready()
            res["server_start_s"] = server.start_s
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(self.target))
            prompts = corpus.read_jsonl(self.work / "drafter_prompts.jsonl")
            bodies = [tok.apply_chat_template(c["messages"][:1], tokenize=False, add_generation_prompt=True)
                      for c in prompts]
            from concurrent.futures import ThreadPoolExecutor

            def gen(k: int) -> dict:
                ids = tok(bodies[k], add_special_tokens=False)["input_ids"]
                r = requests.post(server.url + "/generate", timeout=600, json={
                    "input_ids": ids, "rid": f"nocap-regen-{k}",
                    "sampling_params": {"max_new_tokens": self.a.max_new, "temperature": 0.0}})
                r.raise_for_status()
                return r.json()

            t = time.time()
            with ThreadPoolExecutor(512) as pool:  # all at once: SGLang batches the decode
                outs = list(pool.map(gen, range(len(prompts))))
            res["regen_s"] = round(time.time() - t, 1)
            chats = []
            for c, o in zip(prompts, outs):
                answer = o["text"]
                if answer.strip():
                    chats.append({"messages": [c["messages"][0], {"role": "assistant", "content": answer}]})
            res["regen"] = {"chats": len(chats), "finish": _count(o["meta_info"]["finish_reason"] for o in outs),
                            "example": chats[0]["messages"][1]["content"][:400] if chats else None}
            corpus.write_jsonl(self.work / "drafter_chats.jsonl", chats)
            corpus.write_jsonl(self.work / "drafter_chats_sharegpt.jsonl",
                               [corpus.as_sharegpt(c, i) for i, c in enumerate(chats)])
            t = time.time()
            p = self.hs_extract("drive", "--run", "loop", "--data", str(self.work / "drafter_chats.jsonl"),
                                "--model", str(self.target), "--server", server.url, "--capture-dir", str(cap),
                                "--state-dir", str(self.work / "drive-state"), "--samples-dir", str(samples),
                                "--concurrency", "32")
            res["drive"] = {"rc": p.returncode, "s": round(time.time() - t, 1), "tail": p.stdout[-1500:] + p.stderr[-1500:]}
            if p.returncode:
                raise RuntimeError(f"hs-extract drive failed: {res['drive']}")
        finally:
            server.stop()
        ours = self.work / "feat" / "ours"
        shutil.rmtree(ours, ignore_errors=True)
        t = time.time()
        p = self.hs_extract("export", "--format", "specforge", str(samples), str(ours), "--model", str(self.target),
                            "--json")
        res["export"] = {"rc": p.returncode, "s": round(time.time() - t, 1), "out": p.stdout[-800:], "err": p.stderr[-800:]}
        if p.returncode:
            raise RuntimeError(f"hs-extract export failed: {res['export']}")
        p = self.hs_extract("drafter-config", "--serve-release", "0.5.16", "--export", str(ours),
                            "--model", str(self.target))
        res["drafter_config"] = json.loads(p.stdout) if p.returncode == 0 else {"rc": p.returncode, "err": p.stderr}
        res["features"] = features.summary(ours)
        res["layers"] = json.loads((ours / "export.json").read_text()).get("identity", {}).get("layers")
        return res

    def variants(self) -> dict:
        ours, feat = self.work / "feat" / "ours", self.work / "feat"
        layers = self.state["done"]["extract"]["layers"]
        t = time.time()
        res = {"hf": features.hf_variants(self.target, ours, feat / "hf", feat / "late", layers, self.a.device,
                                           self.log)}
        res["prenorm"] = features.prenorm_variant(self.shm / "loop-samples", ours, feat / "prenorm")
        res["seconds"] = round(time.time() - t, 1)
        return res

    def _install_specforge(self) -> None:
        site = self.work / "sfsite"
        if not (site / "specforge").is_dir():
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--target", str(site), *map(str, sorted((self.carry / "whl").glob("*.whl")))],
                           check=True)

    def _train(self, name: str, feat: Path, seed: int, steps: int, lr: float) -> None:
        d = self.work / "train" / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        (d / "run.yaml").write_text(drafters.run_yaml(
            target=self.target, draft_cfg=self.work / "draft.json", features=feat, out=d / "out", run_id=name,
            steps=steps, batch=self.a.draft_batch, lr=lr, seed=seed, max_length=2048, cache=d / "cache"))
        cmd = (f"{sys.executable} -m specforge.cli train --config {d / 'run.yaml'} > {d / 'train.log'} 2>&1; "
               f"echo $? > {d / 'rc'}")
        subprocess.Popen(["bash", "-c", cmd], env=self.sf_env(), start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # outlives this call; holds no pipe

    def launch(self) -> dict:
        """Trainings on our features (each --seeds) and the floor, started as soon as our export exists."""
        self._install_specforge()
        ext = self.state["done"]["extract"]
        ids = ext["drafter_config"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        drafters.draft_config(json.loads((self.target / "config.json").read_text()), ids, self.work / "draft.json")
        runs = [f"ours-s{k}" for k in range(self.a.seeds)]
        for k, name in enumerate(runs):
            self._train(name, self.work / "feat" / "ours", k, self.a.draft_steps, self.a.draft_lr)
        self._train("untrained", self.work / "feat" / "ours", 0, 1, 1e-12)  # SpecForge's init, one step at lr ~0
        return {"runs": runs + ["untrained"], "eagle_ids": ids, "steps": self.a.draft_steps}

    def launch_variants(self) -> dict:
        for v in ("hf", "late", "prenorm"):
            self._train(v, self.work / "feat" / v, 0, self.a.draft_steps, self.a.draft_lr)
        return {"runs": ["hf", "late", "prenorm"]}

    def specforge(self) -> dict:
        site514 = build_site514(Path(self.a.site), self.carry / "site514.tar.xz", Path("/tmp/site514"))
        self._install_specforge()
        out = self.work / "feat" / "specforge"
        # the script's own caches are keyed by paths and options, not by what the files hold: a re-run after a
        # new extract would read the old chats; its copy in work/specforge keeps its dataset cache
        # (<script dir>/../cache) out of the repository checkout
        sfdir, cache = self.work / "specforge", self.work / "sfcache"
        for d in (out, sfdir, cache):
            shutil.rmtree(d, ignore_errors=True)
        (sfdir / "scripts").mkdir(parents=True)
        script = shutil.copy(self.carry / "prepare_hidden_states.py", sfdir / "scripts")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", str(script),
               *prepare_args(self.target, self.work / "drafter_chats_sharegpt.jsonl", out, self.work / "draft.json",
                             cache)]
        t = time.time()
        log = self.work / "specforge-prepare.log"
        env = self.sf_env(str(site514))
        for k in ("TVM_FFI_CACHE_DIR",):  # 0.5.14's JIT modules apart from 0.5.16's
            env[k] = env.get(k, "/tmp/tvm") + "-514"
        with open(log, "w") as f:
            p = subprocess.Popen(cmd, cwd=self.work, env=env, stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # its own group: a timeout ends torchrun's worker too
            try:
                rc = p.wait(timeout=max(60, int(self.left()) - 30))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    rc = p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    rc = p.wait()
        shutil.copy(log, self.out / log.name)
        lines = log.read_text(errors="replace").splitlines()
        res = {"rc": rc, "s": round(time.time() - t, 1), "tail": lines[-8:],
               "error": [ln for ln in lines if ln.startswith("[rank0]:")][-30:]}  # torchrun's tail hides the cause
        if rc:
            raise RuntimeError(f"prepare_hidden_states.py failed (log: {self.out / log.name}): {res}")
        res["features"] = features.summary(out)
        self._train("specforge", out, 0, self.a.draft_steps, self.a.draft_lr)
        return res

    def drafters_phase(self) -> dict:
        names = sorted(p.name for p in (self.work / "train").iterdir() if p.is_dir())
        res: dict = {"train": {}, "export": {}, "agreement": {}}
        while True:
            pending = [n for n in names if not (self.work / "train" / n / "rc").exists()]
            if not pending:
                break
            if self.left() < 60:
                raise RuntimeError(f"trainings still running: {pending} (resume the loop)")
            time.sleep(5)
        ids = self.state["done"]["launch"]["eagle_ids"]
        for n in names:
            d = self.work / "train" / n
            rc = (d / "rc").read_text().strip()
            res["train"][n] = {"rc": rc, "log": drafters.losses(d / "train.log"),
                               "tail": (d / "train.log").read_text(errors="replace").splitlines()[-4:]}
            dst = self.work / "drafters" / n
            shutil.rmtree(dst, ignore_errors=True)
            e = drafters.export(d / "out", n, self.work / "draft.json", dst, self.sf_env())
            if e.get("rc") == 0:  # the product's eagle_config, written into the exported drafter
                p = self.hs_extract("drafter-config", "--serve-release", "0.5.16", "--layers",
                                    ",".join(map(str, self.state["done"]["extract"]["layers"])), "--model",
                                    str(self.target), "--into", str(dst / "config.json"))
                e["drafter_config"] = {"rc": p.returncode, "err": p.stderr[-300:]}
                e["eagle_ids"] = json.loads((dst / "config.json").read_text())["eagle_config"][
                    "eagle_aux_hidden_state_layer_ids"]
                assert e["eagle_ids"] == ids, (e["eagle_ids"], ids)
            res["export"][n] = e
        head = features.lm_head_of(self.target)
        for v in ("specforge", "hf", "late", "prenorm"):
            if not (self.work / "feat" / v).is_dir():  # a phase left out of --phases
                continue
            res["agreement"][v] = features.agreement(self.work / "feat" / "ours", self.work / "feat" / v, head,
                                                     self.a.device)
        return res

    def serve(self) -> dict:
        """One setting at a time (every drafter's EAGLE-3 server at once), the plain server up throughout."""
        from concurrent.futures import ThreadPoolExecutor

        names = [n for n, e in self.state["done"]["drafters"]["export"].items() if e.get("rc") == 0]
        res: dict = {"failed_to_start": {}, "runs": {}, "start_s": {}}
        mdir = self.work / "measure"
        mdir.mkdir(exist_ok=True)
        plain = serving.start_all(Server, self.target, {"plain": []}, self.a.port + 10, self.log,
                                  time.time() + 300)["servers"].get("plain")
        try:
            for k, setting in enumerate(self.a.settings.split(";")):
                steps, topk, toks = map(int, setting.split(","))
                specs = {f"{n}@{setting}": serving.spec_flags(self.work / "drafters" / n, steps, topk, toks)
                         for n in names}
                started = serving.start_all(Server, self.target, specs, self.a.port + 20 + 20 * k, self.log,
                                            time.time() + 300)
                servers = started["servers"]
                res["failed_to_start"].update({n: v[-1500:] for n, v in started["failed"].items()})
                res["start_s"].update({n: sv.start_s for n, sv in servers.items()})

                def one(name: str) -> tuple[str, dict]:
                    out = mdir / f"{name.replace('@', '_').replace(',', '-')}.json"
                    return name, serving.measure(servers[name].url, self.work / "heldout.jsonl", self.target, out,
                                                 plain.url if plain else None, self.a.max_new, 64, ROOT,
                                                 self.hs_env())

                try:
                    with ThreadPoolExecutor(max(1, len(servers))) as pool:
                        for name, r in pool.map(one, list(servers)):
                            res["runs"][name] = r
                            self.log(f"{name}: accept length {r.get('accept_length')} "
                                     f"greedy {r.get('greedy')}")
                finally:
                    for sv in servers.values():
                        sv.stop()
                self.save()
        finally:
            if plain:
                plain.stop()
        return res

    def table(self) -> dict:
        from loop.report import render

        text = render(self.state, self.a)
        (self.out / "table.md").write_text(text)
        print(text)
        return {"written": str(self.out / "table.md")}

    # ------------------------------------------------------------------ driver
    def run(self, phases: list[str]) -> int:
        fns = {"corpus": self.corpus, "target": self.target_phase, "extract": self.extract, "launch": self.launch,
               "variants": self.variants, "launch_variants": self.launch_variants, "specforge": self.specforge,
               "drafters": self.drafters_phase, "serve": self.serve, "table": self.table}
        for ph in phases:
            if ph in self.state["done"]:
                continue
            need = ESTIMATE_S[ph] + (self.a.target_seconds if ph == "target" else 0)
            if self.left() < need * self.a.estimate_factor:
                self.log(f"stopping before {ph}: {self.left():.0f}s left, it needs about {need:.0f}s; "
                         "run the same command again to continue")
                self.save()
                return 0
            self.log(f"phase {ph} ({self.left():.0f}s left)")
            t = time.time()
            try:
                self.state["done"][ph] = {**fns[ph](), "phase_s": round(time.time() - t, 1)}
            except Exception as e:  # noqa: BLE001 - recorded, the call ends; fix and resume
                self.state.setdefault("errors", {})[ph] = traceback.format_exc()[-4000:]
                self.log(f"phase {ph} FAILED: {e}")
                self.save()
                return 1
            self.save()
        self.log("all phases done")
        return 0


def _count(items) -> dict:
    out: dict = {}
    for x in items:
        key = json.dumps(x, sort_keys=True, default=str)
        out[key] = out.get(key, 0) + 1
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--site", default=os.environ.get("SGLKIT_SITE", "/tmp/site"), help="the 0.5.16 site (patched)")
    ap.add_argument("--work", default="/tmp/loop")
    ap.add_argument("--out", default=os.environ.get("OUT", "loop-out"))
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--deadline", type=float, default=560, help="seconds this call may run")
    ap.add_argument("--estimate-factor", type=float, default=1.0, help="scale the phase estimates")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--block", type=int, default=512, help="target training sequence length")
    ap.add_argument("--batch", type=int, default=64, help="target training batch (sequences)")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--target-seconds", type=float, default=130)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-chats", type=int, default=80000, help="at most this many chats (evenly spread) train "
                    "the target")
    ap.add_argument("--drafter-chats", type=int, default=2000)
    ap.add_argument("--heldout", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--draft-steps", type=int, default=1000)
    ap.add_argument("--draft-batch", type=int, default=4)
    ap.add_argument("--draft-lr", type=float, default=5e-4)
    ap.add_argument("--seeds", type=int, default=2, help="trainings on our features (the run-to-run spread)")
    ap.add_argument("--settings", default="3,1,4;7,1,8", help="(steps,topk,draft tokens);...")
    ap.add_argument("--port", type=int, default=31000)
    ap.add_argument("--shm", default="/dev/shm", help="where the capture and samples dirs go (tmpfs, as in "
                    "production)")
    ap.add_argument("--device", default="cuda", help="where the target trains and transformers runs")
    ap.add_argument("--capture-layers", default="", help="HS_CAPTURE_LAYERS of the capturing server (default: "
                    "unset, the product's default for the model's depth)")
    ap.add_argument("--carry", default=str(ROOT / ".loopcarry"), help="tests/gpu/loop/build_carry.sh's output")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    Path(a.work).mkdir(parents=True, exist_ok=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    REC.out = Path(a.out)
    REC.logs = Path(a.work) / "logs"
    REC.logs.mkdir(exist_ok=True)
    return Loop(a).run([p for p in a.phases.split(",") if p])


if __name__ == "__main__":
    sys.exit(main())
