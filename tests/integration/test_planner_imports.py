"""The planner imports neither torch nor deepspeed nor omegaconf (checked in a fresh interpreter)."""
from __future__ import annotations



from malleus_ds.planner import PlannerConfig

FAST = PlannerConfig(pop_size=12, max_generations=8, patience=4)
SD = {1: {"1": 1.0}, 2: {"1": 1.0, "2": 1.9}, 4: {"1": 1.0, "2": 1.9, "4": 3.66},
      8: {"1": 1.0, "2": 1.9, "4": 3.66, "8": 7.22}}


# copies of the example problems (examples/*.json), inline so the tests stand alone
EXAMPLES = {'problem_64gpu_one_slow': {'version': 1,
                            'name': 'example_64gpu_one_slow',
                            'cluster': {'nodes': 8, 'gpus_per_node': 8},
                            'model': {'num_layers': 80},
                            'training': {'global_batch_size': 64,
                                         'micro_batch_size': 1,
                                         'tp': 8,
                                         'pp': 4,
                                         'dp': 2},
                            'cost': {'tp_slowdown': {'1': 1.0, '2': 1.9, '4': 3.66, '8': 7.22}},
                            'memory': {'device_mb': 81920,
                                       'reserved_mb': 4096,
                                       'layer_static_mb': 1200,
                                       'layer_activation_mb': 260,
                                       'embedding_mb': 1200,
                                       'extra_mb': 3000},
                            'rates': {'9': 4.0},
                            'current_plan': None},
 'problem_32gpu_two_slow': {'version': 1,
                            'name': 'example_32gpu_two_slow',
                            'cluster': {'nodes': 4, 'gpus_per_node': 8},
                            'model': {'num_layers': 48},
                            'training': {'global_batch_size': 32,
                                         'micro_batch_size': 1,
                                         'tp': 4,
                                         'pp': 4,
                                         'dp': 2},
                            'cost': {'tp_slowdown': {'1': 1.0, '2': 1.9, '4': 3.66}},
                            'memory': {'device_mb': 81920,
                                       'reserved_mb': 4096,
                                       'layer_static_mb': 1200,
                                       'layer_activation_mb': 260,
                                       'embedding_mb': 1200,
                                       'extra_mb': 3000},
                            'rates': {'2': 2.0, '27': 6.0},
                            'current_plan': None}}


def test_planner_imports_neither_torch_nor_deepspeed_nor_omegaconf():
    import subprocess
    import sys

    code = ("import sys\n"
            "from malleus_ds.problem import Problem\n"
            "from malleus_ds.planner import plan\n"
            "import malleus_ds.cost, malleus_ds.simulate, malleus_ds.app.cli\n"
            f"pr = Problem.from_json({EXAMPLES['problem_32gpu_two_slow']!r})\n"
            "plan(pr, time_limit=0.5)\n"
            "bad = [m for m in ('torch', 'deepspeed', 'omegaconf') if m in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
