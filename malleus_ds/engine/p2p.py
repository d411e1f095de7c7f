"""Pipeline point-to-point for MalleusEngine: the activation and gradient sends and receives
that ``train_batch`` dispatches for ``SendAct`` / ``RecvAct`` / ``SendGrad`` / ``RecvGrad``
(``schedule.py``). The schedule loop is ``train_step.py``; the wire is here (a mixin: it reads the
engine's per-plan peers ``act_src`` / ``act_dsts`` / ``grad_src`` / ``grad_dsts`` and its
per-step buffers ``_outputs`` / ``_inputs`` / ``_grads_in`` / ``_grads_out`` / ``_sends``)."""
from __future__ import annotations

import torch
import torch.distributed as tdist

from ..resilience.watchdog import phase
from .comm_log import tensor_mb
from ..schedule import RecvAct, SendAct


class PipelineP2P:
    """Runs a rank's p2p calls exactly as ``wire.wire_calls`` cuts them (``wire.nccl_problems``
    checks every plan against NCCL's rules): EVERY message goes through ``batch_isend_irecv``,
    so on NCCL all of a pair's messages share one communicator and are matched in issue order
    (single ``isend``/``recv`` would take another communicator without eager init). A send
    followed directly by a receive (1F1B's steady state: "SA k, RG i" and "SG i, RA k+1") is ONE
    call: a send completes only when matched, so two calls could leave both neighbours waiting
    on each other (Megatron's send_forward_recv_backward). Sends return at once, receives are
    waited for. Tags are set but nothing depends on them."""

    def _act_shape(self) -> tuple[int, int, int]:
        return (self.plan.micro_batch_size, self.seq_len, self.model_cfg.hidden_size)

    def _send_parts(self, ins) -> tuple[torch.Tensor, list[int]]:
        if isinstance(ins, SendAct):
            return self._outputs[ins.micro_batch].detach().contiguous(), self.act_dsts
        return self._grads_in.pop(ins.micro_batch).contiguous(), self.grad_dsts

    def _recv_parts(self, ins) -> tuple[torch.Tensor, int]:
        buf = torch.empty(self._act_shape(), dtype=self.act_dtype, device=self.device)
        return buf, (self.act_src if isinstance(ins, RecvAct) else self.grad_src)

    def _recv_done(self, ins, buf: torch.Tensor) -> None:
        if isinstance(ins, RecvAct):
            self._inputs[ins.micro_batch] = buf.requires_grad_()
        else:
            self._grads_out[ins.micro_batch] = buf

    def _prune_sends(self) -> None:
        # keep only unfinished isends alive: bounds send buffers by what is really in flight
        self._sends = [(h, t) for h, t in self._sends if not h.is_completed()]

    def _exec_send(self, ins) -> None:
        self._prune_sends()
        t, dsts = self._send_parts(ins)
        if dsts:
            reqs = tdist.batch_isend_irecv([tdist.P2POp(tdist.isend, t, d, tag=ins.micro_batch)
                                            for d in dsts])
            self._sends.extend((r, t) for r in reqs)

    def _exec_recv(self, ins) -> None:
        buf, src = self._recv_parts(ins)
        (req,) = tdist.batch_isend_irecv([tdist.P2POp(tdist.irecv, buf, src,
                                                      tag=ins.micro_batch)])
        with phase("p2p"), self.clock.comm((self.global_rank, src), tensor_mb(buf)):
            req.wait()
        self._recv_done(ins, buf)

    def _exec_send_recv(self, send, recv) -> None:
        self._prune_sends()
        t, dsts = self._send_parts(send)
        buf, src = self._recv_parts(recv)
        ops = [tdist.P2POp(tdist.isend, t, d, tag=send.micro_batch) for d in dsts]
        ops.append(tdist.P2POp(tdist.irecv, buf, src, tag=recv.micro_batch))
        reqs = tdist.batch_isend_irecv(ops)
        self._sends.extend((r, t) for r in reqs[:-1])
        with phase("p2p"), self.clock.comm((self.global_rank, src), tensor_mb(buf)):
            reqs[-1].wait()
        self._recv_done(recv, buf)
