"""What every script here shares: a tiny MLP on random data, a loss, and the faults a test asks for.

Faults come from the environment, only on the attempt named (ULYSSESD_ATTEMPT, set by the daemon):
  YJ_NAN_AT=N      the loss becomes NaN from step N on (the weights are poisoned, later saves too)
  YJ_FAULT_ATTEMPT the attempt the fault happens on (default 1)
  YJ_STEP_SLEEP    seconds per step (default 0.04)
  YJ_GRAD_NAN_AT=N the update of step N makes the weights NaN while step N's printed loss is still finite
                   (an inf in the backward only): the first NaN loss printed is step N+1's
  YJ_PAUSE_AT=N:S  sleep S seconds before step N (a slow data loader), every attempt
  YJ_HANG_AT=N     stop making progress at step N (sleep for an hour) on the fault attempt
"""
import os
import time

import torch

torch.set_num_threads(1)


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return model, opt


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 16, generator=g)
    y = x[:, :1] * 0.5 + 0.1
    return x, y


def fault_attempt() -> bool:
    return os.environ.get("ULYSSESD_ATTEMPT", "1") == os.environ.get("YJ_FAULT_ATTEMPT", "1")


def train_step(model, opt, step: int) -> float:
    pause = os.environ.get("YJ_PAUSE_AT")
    if pause and int(pause.split(":")[0]) == step:
        time.sleep(float(pause.split(":")[1]))
    hang = os.environ.get("YJ_HANG_AT")
    if hang and fault_attempt() and step == int(hang):
        time.sleep(3600)
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y) + 1.0
    nan_at = os.environ.get("YJ_NAN_AT")
    if nan_at and fault_attempt() and step >= int(nan_at):
        loss = loss * float("nan")
    opt.zero_grad()
    loss.backward()
    gnan = os.environ.get("YJ_GRAD_NAN_AT")
    if gnan and fault_attempt() and step == int(gnan):
        next(model.parameters()).grad.fill_(float("inf"))
    opt.step()
    time.sleep(float(os.environ.get("YJ_STEP_SLEEP", "0.04")))
    return float(loss.item())
