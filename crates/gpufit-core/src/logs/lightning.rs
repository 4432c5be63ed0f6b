//! PyTorch Lightning logs.
//!
//! Lightning prints a banner (`GPU available: True (cuda), used: True`,
//! `LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: [0]`), a progress bar per epoch —
//! tqdm: `Epoch 0:  45%|████▌     | 450/1000 [01:23<01:42,  5.38it/s, v_num=0, train_loss=1.23]`,
//! or rich: `Epoch 2/2  ━━━━━━━━━━━━━━━━━━━━ 250/250 0:00:37 • 0:00:00 6.71it/s v_num: 1.000`
//! — and when fitting ends: `` `Trainer.fit` stopped: `max_epochs=3` reached. ``
//! Lightning does not print samples per second: the bar's rate is
//! iterations (micro batches) per second, kept as `steps_per_sec`.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use regex::Regex;

use super::{median, num, LogFormat, ParsedLog};

static TQDM: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"^\s*Epoch ([0-9]+):\s+[0-9]+%\|[^|]*\|\s*([0-9]+)/([0-9?]+)\s*\[([0-9:]+)<[^,\]]*,\s*([0-9.]+)(it/s|s/it)",
    )
    .expect("static regex")
});
static RICH: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"^\s*Epoch ([0-9]+)/[0-9]+\s+[^0-9]*?([0-9]+)/([0-9]+)\s+([0-9]+:[0-9]{2}:[0-9]{2})\s+•\s+\S+\s+([0-9.]+)(it/s|s/it)",
    )
    .expect("static regex")
});
static FIT_STOPPED: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"`Trainer\.fit` stopped: `?(max_epochs|max_steps|max_time)").expect("static regex")
});

/// The PyTorch Lightning log parser: what it has read of a log so far.
#[derive(Debug, Default)]
pub struct LightningParser {
    seen: bool,
    completed: bool,
    /// Per epoch: (elapsed seconds, iterations per second) of its latest bar update.
    epochs: BTreeMap<u64, (f64, f64)>,
}

/// `MM:SS` or `H:MM:SS` → seconds.
fn clock(s: &str) -> Option<f64> {
    let mut total = 0.0;
    for part in s.split(':') {
        total = total * 60.0 + num(part)?;
    }
    Some(total)
}

/// Upper bound on epochs tracked, so a pathological log cannot grow memory.
const MAX_EPOCHS: usize = 100_000;

impl LightningParser {
    /// Feeds one line (terminator removed, trailing space trimmed).
    pub fn feed(&mut self, line: &str) {
        if line.contains("Trainer.fit") && FIT_STOPPED.is_match(line) {
            self.seen = true;
            self.completed = true;
            return;
        }
        if line.starts_with("GPU available: ") || line.starts_with("LOCAL_RANK: ") {
            self.seen = true;
            return;
        }
        if !line.contains("Epoch ") {
            return;
        }
        let caps = TQDM.captures(line).or_else(|| RICH.captures(line));
        let Some(c) = caps else { return };
        let (Ok(epoch), Some(elapsed), Some(rate)) =
            (c[1].parse::<u64>(), clock(&c[4]), num(&c[5]))
        else {
            return;
        };
        let it_per_s = if &c[6] == "s/it" {
            if rate > 0.0 {
                1.0 / rate
            } else {
                return;
            }
        } else {
            rate
        };
        self.seen = true;
        if self.epochs.len() < MAX_EPOCHS || self.epochs.contains_key(&epoch) {
            self.epochs.insert(epoch, (elapsed, it_per_s));
        }
    }

    /// Writes what was found; returns whether `Trainer.fit` stopped normally.
    pub fn finish(self, out: &mut ParsedLog) -> bool {
        if !self.seen {
            return false;
        }
        out.formats.push(LogFormat::Lightning);
        if !self.epochs.is_empty() {
            let total: f64 = self.epochs.values().map(|(e, _)| e).sum();
            if out.duration_sec.is_none() && total > 0.0 {
                out.duration_sec = Some(total);
            }
            let rates: Vec<f64> = self.epochs.values().map(|(_, r)| *r).collect();
            if out.steps_per_sec.is_none() {
                out.steps_per_sec = median(&rates);
            }
        }
        self.completed
    }
}

#[cfg(test)]
mod tests {
    use super::super::{parse_str, LogOutcome};
    use super::*;

    #[test]
    fn tqdm_bars_give_rate_and_summed_epoch_time() {
        let p = parse_str(
            "GPU available: True (cuda), used: True\n\
             Epoch 0: 100%|██████████| 500/500 [01:40<00:00,  5.00it/s, v_num=0, train_loss=1.23]\n\
             Validation DataLoader 0: 100%|██████████| 50/50 [00:02<00:00, 20.10it/s]\n\
             Epoch 1: 100%|██████████| 500/500 [01:40<00:00,  5.00it/s, v_num=0, train_loss=1.01]\n\
             `Trainer.fit` stopped: `max_epochs=2` reached.\n",
        )
        .unwrap();
        assert_eq!(p.formats, vec![LogFormat::Lightning]);
        assert_eq!(p.steps_per_sec, Some(5.0));
        assert_eq!(p.duration_sec, Some(200.0));
        assert_eq!(p.outcome, Some(LogOutcome::Completed));
    }

    #[test]
    fn seconds_per_iteration_is_inverted() {
        let p = parse_str("Epoch 0:  10%|█         | 10/100 [00:40<06:00,  4.00s/it, v_num=3]\n")
            .unwrap();
        assert_eq!(p.steps_per_sec, Some(0.25));
        assert_eq!(p.outcome, Some(LogOutcome::Unknown));
    }

    #[test]
    fn rich_progress_bars_are_read() {
        let p = parse_str(
            "Epoch 2/2  ━━━━━━━━━━━━━━━━━━━━━━━━━━ 250/250 0:00:37 • 0:00:00 6.71it/s v_num: 1.000 train_loss: 0.050\n",
        )
        .unwrap();
        assert_eq!(p.steps_per_sec, Some(6.71));
        assert_eq!(p.duration_sec, Some(37.0));
    }
}
