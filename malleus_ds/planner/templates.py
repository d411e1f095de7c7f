"""The discrete layout space (DESIGN.md §4a-b) and its genome encoding, shared by the seeds,
the genetic search and the evaluation.

A *layout* is: a grouping option per straggling node, a number of pipelines ``P``, which
pipeline each non-nominal group joins, and how many healthy full groups each pipeline gets.
Healthy full groups are interchangeable, so only their count per pipeline matters here (which
concrete group goes where is placement's job). Identical pipelines share one exact time model.

Genome (integers, one encode/decode for everything):

    x[0]                      P, number of pipelines, in [1, P_max]
    x[1]                      healthy-fill policy: 0 = equalise depth, 1 = equalise throughput
    x[2 : 2+n_special]        grouping option of each straggling node
    x[2+n_special : ]         per straggling node, per possible group: a slot in [0, P_max);
                              the group joins pipeline ``slot * P // P_max``
"""
from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ..cost import comm_spec, head_layers
from ..problem import Problem
from .batch import split_batches
from .grouping import Group, NodeOption, is_healthy_full, node_options, nominal_groups
from .partition import PipelineModel

INFEASIBLE = 1e30


@dataclass
class PipeSpec:
    specials: list[Group]
    n_healthy: int

    def key(self, tp: int) -> tuple:
        return tuple(sorted((gr.y, gr.g) for gr in self.specials)) + ((1.0, tp),) * self.n_healthy


@dataclass
class Layout:
    pipes: list[PipeSpec]
    suspended: tuple[int, ...]
    healthy_pool: list[Group]


@dataclass
class Evaluation:
    T: float
    keys: list[tuple]          # per pipeline
    ms: list[int]              # per pipeline


class SearchSpace:
    def __init__(self, problem: Problem, num_pipelines: int | None = None):
        """``num_pipelines`` fixes P (Malleus keeps ``dp``); None searches it."""
        self.problem = problem
        pr = problem
        self.tp, self.L, job = pr.tp, pr.num_layers, pr.job
        self.M = pr.global_batch_size // pr.micro_batch_size
        rates = {r: pr.rate(r) for r in pr.rates}
        self.special_nodes = job.nodes_of([r for r, x in rates.items() if x != 1.0])
        sp = set(self.special_nodes)
        self.options: list[list[NodeOption]] = [
            node_options(job.node_ranks(n), self.tp, rates, pr.tp_slowdown)
            for n in self.special_nodes]
        self.base_pool: list[Group] = []
        for n in range(job.nodes):
            if n not in sp:
                self.base_pool.extend(nominal_groups(job.node_ranks(n), self.tp, rates,
                                                     pr.tp_slowdown))
        self.max_groups = [max(len(o.groups) for o in opts) for opts in self.options]
        total_groups = len(self.base_pool) + sum(self.max_groups)
        self.P_max = max(1, min(total_groups, self.M))
        self.slot_offset = []
        off = 2 + len(self.special_nodes)
        for mg in self.max_groups:
            self.slot_offset.append(off)
            off += mg
        self.n_var = off
        self.xl = np.zeros(self.n_var, dtype=np.int64)
        self.xu = np.zeros(self.n_var, dtype=np.int64)
        self.xl[0], self.xu[0] = 1, self.P_max
        if num_pipelines is not None:
            self.xl[0] = self.xu[0] = max(1, min(num_pipelines, self.P_max))
        self.xu[1] = 1
        for i, opts in enumerate(self.options):
            self.xu[2 + i] = len(opts) - 1
        self.xu[2 + len(self.special_nodes):] = self.P_max - 1
        # with a comm section, charge every stage boundary the inter-node cost (an upper bound:
        # placement may put neighbours on one node); the final choice uses the exact cost
        cs = comm_spec(problem)
        self.link = cs.boundary(False) if cs is not None else 0.0
        self.head = head_layers(problem)
        self._models: dict[tuple, PipelineModel] = {}
        self._cache: dict[tuple, Evaluation | None] = {}
        self.evaluations = 0

    # -- models --------------------------------------------------------------------------
    def model(self, key: tuple) -> PipelineModel:
        md = self._models.get(key)
        if md is None:
            md = PipelineModel(key, self.L, self.tp, self.problem.memory, self.link, self.head,
                               self.problem.activation_checkpointing)
            self._models[key] = md
        return md

    # -- decode --------------------------------------------------------------------------
    def decode(self, x) -> Layout:
        x = np.clip(np.asarray(x, dtype=np.int64), self.xl, self.xu)
        P, policy = int(x[0]), int(x[1])
        pipes = [PipeSpec([], 0) for _ in range(P)]
        pool = list(self.base_pool)
        susp: list[int] = []
        for i, opts in enumerate(self.options):
            opt = opts[int(x[2 + i])]
            susp.extend(opt.suspended)
            for k, gr in enumerate(opt.groups):
                if is_healthy_full(gr, self.tp):
                    pool.append(gr)
                    continue
                p = int(x[self.slot_offset[i] + k]) * P // self.P_max
                pipes[min(p, P - 1)].specials.append(gr)
        phi = [sum(1.0 / gr.y for gr in ps.specials) for ps in pipes]
        depth = [len(ps.specials) for ps in pipes]
        if policy == 0:
            heap = [(depth[p], phi[p], p) for p in range(P)]
        else:
            heap = [(phi[p], depth[p], p) for p in range(P)]
        heapq.heapify(heap)
        for _ in range(len(pool)):
            _, _, p = heapq.heappop(heap)
            pipes[p].n_healthy += 1
            depth[p] += 1
            phi[p] += 1.0
            heapq.heappush(heap, (depth[p], phi[p], p) if policy == 0 else (phi[p], depth[p], p))
        pipes = [ps for ps in pipes if ps.specials or ps.n_healthy]
        return Layout(pipes, tuple(sorted(susp)), pool)

    # -- evaluate ------------------------------------------------------------------------
    def evaluate_layout(self, lay: Layout) -> Evaluation | None:
        keys = [ps.key(self.tp) for ps in lay.pipes]
        if not keys:
            return None
        cnt = Counter(keys)
        uniq = list(cnt)
        models = [self.model(k) for k in uniq]
        res = split_batches(models, [cnt[k] for k in uniq], self.M)
        if res is None:
            return None
        T, ms_lists = res
        pos = {k: i for i, k in enumerate(uniq)}
        taken = {k: 0 for k in uniq}
        ms = []
        for k in keys:
            i = pos[k]
            ms.append(ms_lists[i][taken[k]])
            taken[k] += 1
        return Evaluation(T, keys, ms)

    def evaluate(self, x) -> tuple[float, Layout, Evaluation | None]:
        x = np.clip(np.asarray(x, dtype=np.int64), self.xl, self.xu)
        lay = self.decode(x)
        k = tuple(x.tolist())
        if k in self._cache:
            ev = self._cache[k]
        else:
            self.evaluations += 1
            ev = self.evaluate_layout(lay)
            self._cache[k] = ev
        return (ev.T if ev is not None else INFEASIBLE), lay, ev

    # -- heuristic seeds ---------------------------------------------------------------
    def encode(self, P: int, policy: int, choice: list[int], assign: list[list[int]]) -> np.ndarray:
        """Genome for ``P`` pipelines; ``assign[i][k]`` = pipeline of group ``k`` of node ``i``."""
        x = np.zeros(self.n_var, dtype=np.int64)
        x[0], x[1] = P, policy
        for i, c in enumerate(choice):
            x[2 + i] = c
            for k, p in enumerate(assign[i]):
                x[self.slot_offset[i] + k] = -(-p * self.P_max // P)  # ceil: decodes back to p
        return np.clip(x, self.xl, self.xu)

    def from_plan(self, plan) -> list[np.ndarray]:
        """The running plan as genomes (both fill policies), to warm-start a re-plan from it:
        its number of pipelines; per straggling node, the grouping option whose groups are
        TP groups of the plan (and whose suspended ranks it suspends), else the first; each of
        that option's groups in the pipeline the plan has it in. Empty when the plan's pipeline
        count is outside this space."""
        P = len(plan.pipelines)
        if not int(self.xl[0]) <= P <= int(self.xu[0]):
            return []
        where = {tuple(sorted(st.ranks)): i for i, p in enumerate(plan.pipelines)
                 for st in p.stages}
        out_ranks = set(plan.suspended)
        choice, assign = [], []
        for opts in self.options:
            c = next((j for j, o in enumerate(opts)
                      if set(o.suspended) <= out_ranks
                      and all(tuple(sorted(g.ranks)) in where for g in o.groups)), 0)
            choice.append(c)
            assign.append([where.get(tuple(sorted(g.ranks)), 0) for g in opts[c].groups])
        return [self.encode(P, policy, choice, assign) for policy in (0, 1)]

    def min_healthy_depth(self) -> int:
        """Fewest healthy full groups one pipeline needs to hold the model in memory."""
        for S in range(1, self.L + 1):
            if self.model(((1.0, self.tp),) * S).feasible:
                return S
        return self.L

    def seeds(self) -> list[np.ndarray]:
        n_nodes_groups = self.problem.num_gpus // self.tp
        s_min = self.min_healthy_depth()
        Ps = {self.problem.dp}
        for S in range(s_min, s_min + 4):
            Ps.add(n_nodes_groups // S)
            Ps.add(-(-n_nodes_groups // S))
        Ps.add(n_nodes_groups // s_min - 1)
        Ps = sorted({min(max(p, int(self.xl[0])), int(self.xu[0])) for p in Ps})
        choices = []
        for lam in (None, 1.0, 0.1, 0.03, 0.0):
            ch = []
            for opts in self.options:
                if lam is None:
                    ch.append(0)
                else:
                    ch.append(max(range(len(opts)),
                                  key=lambda j: opts[j].throughput - lam * len(opts[j].groups)))
            if ch not in choices:
                choices.append(ch)
        out = []
        for P in Ps:
            for ch in choices:
                for mode in ("spread", "node", "pack"):
                    assign = self._assign(P, ch, mode)
                    for policy in (0, 1):
                        out.append(self.encode(P, policy, ch, assign))
        return out

    def _assign(self, P: int, choice: list[int], mode: str) -> list[list[int]]:
        heap = [(0.0, p) for p in range(P)]
        assign = [[0] * len(self.options[i][c].groups) for i, c in enumerate(choice)]
        if mode == "pack":
            # slow groups together, filling pipelines to the average depth one after another:
            # a few slow pipelines then get fewer micro-batches (data-only within the layout)
            depth = max(1, -(-(self.problem.num_gpus // self.tp) // P))
            items = sorted(((gr.y, i, k) for i, c in enumerate(choice)
                            for k, gr in enumerate(self.options[i][c].groups)), reverse=True)
            for n, (_, i, k) in enumerate(items):
                assign[i][k] = min(n // depth, P - 1)
        elif mode == "node":
            items = sorted(((sum(1.0 / g.y for g in self.options[i][c].groups), i)
                            for i, c in enumerate(choice)), reverse=True)
            for w, i in items:
                l, p = heapq.heappop(heap)
                assign[i] = [p] * len(assign[i])
                heapq.heappush(heap, (l + w, p))
        else:
            items = sorted(((1.0 / gr.y, i, k) for i, c in enumerate(choice)
                            for k, gr in enumerate(self.options[i][c].groups)), reverse=True)
            for w, i, k in items:
                l, p = heapq.heappop(heap)
                assign[i][k] = p
                heapq.heappush(heap, (l + w, p))
        return assign
