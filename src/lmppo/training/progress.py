"""Training progress: on the CLI's console a live rich bar on a terminal, one plain line per iteration elsewhere;
through the Python API (no console) a tqdm bar, as transformers' Trainer shows (`log.progress: false` hides both)."""

from __future__ import annotations

import atexit
from typing import TYPE_CHECKING, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from lmppo.run.metrics_file import controller_beta

if TYPE_CHECKING:
    from tqdm.auto import tqdm


class ProgressDisplay:
    """The progress of one training session (`PPOTrainer.finish_iteration` calls `show` after every iteration).

    On a terminal (and with `log.progress`): one live rich bar, iteration/total with the latest score, KL,
    beta, episodes per second and the time left, redrawn in place below the sample tables. Elsewhere (CI,
    output piped to a file, `log.progress: false`): one plain line per iteration."""

    def __init__(self) -> None:
        self.bar: Optional[Progress] = None  # the live bar, once started
        self.task: Optional[TaskID] = None
        self.tqdm_bar: Optional[tqdm] = None  # the Python API's bar (no console)

    def show(
        self,
        console: Optional[Console],
        live: bool,
        iteration: int,
        total: int,
        episode: int,
        train_seconds: float,
        m: Optional[dict[str, float]],
    ) -> None:
        """Progress after iteration `iteration` of `total` (metrics `m`; None: before the first one of this
        session); `live`: `log.progress` (a live bar when the console is a terminal)."""
        stats = ""
        if m is not None:
            left = train_seconds / max(iteration, 1) * max(total - iteration, 0)
            stats = (
                f"score {m['objective/scores']:+.3f}  kl {m['objective/kl']:.2f}  "
                f"beta {controller_beta(m):.4f}  len {m['response/length_mean']:.1f}  "
                f"{m['eps']:.2f} eps  ~{int(left) // 60}:{int(left) % 60:02d} left"
            )
        if console is None:  # the Python API (a notebook, a script): tqdm's bar, unless log.progress is off
            if live:
                self.api_bar(iteration, total, stats)
            return
        if not (live and console.is_terminal and not console.is_dumb_terminal):
            if m is not None:
                console.print(
                    f"[bold]iter {iteration}/{total}[/] episode {episode}  {stats}  "
                    f"rlhf {m['objective/rlhf_reward']:+.3f}  ratio {m.get('val/ratio', 1.0):.3f}",
                    highlight=False,
                    soft_wrap=True,
                )  # one line per iteration in a log file
            return
        bar = self.bar
        if bar is None:
            bar = Progress(
                TextColumn("[bold]PPO iter[/]"),
                BarColumn(bar_width=30),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                console=console,
                refresh_per_second=1,
            )
            done = iteration - (m is not None)
            self.task = bar.add_task(
                "ppo", total=total, completed=done, stats="(first iteration: sampling, scoring, updating)"
            )
            bar.start()
            atexit.register(bar.stop)  # the cursor comes back even if training stops with an error
            self.bar = bar
        if m is not None and self.task is not None:
            bar.update(self.task, completed=iteration, stats=stats)
        if iteration >= total:
            self.close()

    def api_bar(self, iteration: int, total: int, stats: str) -> None:
        """A tqdm bar (a widget in a notebook, text on stderr elsewhere; TQDM_DISABLE=1 hides it)."""
        from tqdm.auto import tqdm

        if self.tqdm_bar is None:
            self.tqdm_bar = tqdm(total=total, initial=iteration, desc="PPO", unit="iter", dynamic_ncols=True)
        bar = self.tqdm_bar
        bar.n = iteration
        if stats:
            bar.set_postfix_str(stats, refresh=False)
        bar.refresh()
        if iteration >= total:
            self.close()

    def close(self) -> None:
        """End the bars of a session that stops before its last iteration (`stop()`, an error). A tqdm bar left
        open prints itself again when it is collected or at exit, after whatever the user's script printed since."""
        if self.tqdm_bar is not None:
            self.tqdm_bar.close()
            self.tqdm_bar = None
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
