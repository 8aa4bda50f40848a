//! The `--devices` flag: `cpu` | `cpu:N` | `gpu:all` | `gpu:0,1,...`.

use super::CommError;

/// Where a group's ranks run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSpec {
    /// `ranks` threads of this process (`cpu` means one).
    Cpu { ranks: usize },
    /// One rank per GPU.
    Gpu(GpuSelection),
}

/// Which GPUs, in rank order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuSelection {
    /// Every visible GPU, rank `i` on device `i`.
    All,
    /// These device ordinals (distinct), rank `i` on `ids[i]`.
    Ids(Vec<usize>),
}

impl DeviceSpec {
    /// Number of ranks, when known without asking the driver (`None` for
    /// `gpu:all`).
    pub fn world_size(&self) -> Option<usize> {
        match self {
            DeviceSpec::Cpu { ranks } => Some(*ranks),
            DeviceSpec::Gpu(GpuSelection::All) => None,
            DeviceSpec::Gpu(GpuSelection::Ids(ids)) => Some(ids.len()),
        }
    }
}

const GRAMMAR: &str = "expected cpu, cpu:N, gpu:all or gpu:I,J,... (e.g. gpu:0,1)";

/// Parses a `--devices` value. Spaces around items are ignored; ids must be
/// distinct (NCCL puts one rank per GPU) and counts at least 1.
pub fn parse_devices(s: &str) -> Result<DeviceSpec, CommError> {
    let bad = |why: &str| CommError::InvalidDevices(format!("{s:?}: {why}; {GRAMMAR}"));
    let s_trim = s.trim();
    let (kind, arg) = match s_trim.split_once(':') {
        Some((k, a)) => (k.trim(), Some(a.trim())),
        None => (s_trim, None),
    };
    match (kind, arg) {
        ("cpu", None) => Ok(DeviceSpec::Cpu { ranks: 1 }),
        ("cpu", Some(n)) => match n.parse::<usize>() {
            Ok(0) => Err(bad("cpu needs at least 1 rank")),
            Ok(ranks) => Ok(DeviceSpec::Cpu { ranks }),
            Err(_) => Err(bad("cpu:N takes a rank count")),
        },
        ("gpu", None) => Err(bad("gpu needs :all or a list of device ids")),
        ("gpu", Some("all")) => Ok(DeviceSpec::Gpu(GpuSelection::All)),
        ("gpu", Some(list)) => {
            let mut ids = Vec::new();
            for item in list.split(',') {
                let id = item
                    .trim()
                    .parse::<usize>()
                    .map_err(|_| bad(&format!("{:?} is not a device id", item.trim())))?;
                if ids.contains(&id) {
                    return Err(bad(&format!("device {id} listed twice")));
                }
                ids.push(id);
            }
            Ok(DeviceSpec::Gpu(GpuSelection::Ids(ids)))
        }
        _ => Err(bad("unknown device kind")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_grammar() {
        let ok = |s: &str| parse_devices(s).map_err(|e| e.to_string());
        assert_eq!(ok("cpu"), Ok(DeviceSpec::Cpu { ranks: 1 }));
        assert_eq!(ok("cpu:3"), Ok(DeviceSpec::Cpu { ranks: 3 }));
        assert_eq!(ok(" cpu : 2 "), Ok(DeviceSpec::Cpu { ranks: 2 }));
        assert_eq!(ok("gpu:all"), Ok(DeviceSpec::Gpu(GpuSelection::All)));
        assert_eq!(ok("gpu:0"), Ok(DeviceSpec::Gpu(GpuSelection::Ids(vec![0]))));
        assert_eq!(
            ok("gpu:0, 1,3"),
            Ok(DeviceSpec::Gpu(GpuSelection::Ids(vec![0, 1, 3])))
        );
        assert_eq!(
            ok("gpu:1,0"),
            Ok(DeviceSpec::Gpu(GpuSelection::Ids(vec![1, 0])))
        );
    }

    #[test]
    fn world_size_of_spec() {
        assert_eq!(DeviceSpec::Cpu { ranks: 4 }.world_size(), Some(4));
        assert_eq!(DeviceSpec::Gpu(GpuSelection::All).world_size(), None);
        assert_eq!(
            DeviceSpec::Gpu(GpuSelection::Ids(vec![2, 5])).world_size(),
            Some(2)
        );
    }

    #[test]
    fn rejects_malformed_values_with_the_grammar() {
        for s in [
            "",
            "gpu",
            "gpu:",
            "gpu:0,",
            "gpu:0,0",
            "gpu:-1",
            "gpu:a",
            "gpu:0;1",
            "cpu:0",
            "cpu:x",
            "cpu:",
            "tpu:0",
            "GPU:0",
            "gpu:all,0",
        ] {
            match parse_devices(s) {
                Err(CommError::InvalidDevices(msg)) => {
                    assert!(msg.contains("gpu:all"), "{s:?}: {msg}");
                }
                other => panic!("{s:?} gave {other:?}"),
            }
        }
    }
}
