//! The NCCL communicator's host side: device lists
//! are validated before CUDA is touched, and without a driver, libnccl or
//! GPU (this project's CI) a group is a clean `NotAvailable`; on a lent
//! GPU machine, a group over every GPU runs each collective.

#![allow(clippy::unwrap_used)]

use tandem_engine::comm::{CommError, Communicator, NcclComm};

#[test]
fn bad_device_lists_are_rejected_before_touching_cuda() {
    assert!(matches!(
        NcclComm::new_group(&[]),
        Err(CommError::InvalidDevices(_))
    ));
    assert!(matches!(
        NcclComm::new_group(&[0, 1, 0]),
        Err(CommError::InvalidDevices(_))
    ));
}

/// Without a driver, libnccl or GPU (this project's CI) a group is a
/// clean `NotAvailable`, never a panic; with GPUs, one rank per GPU
/// must match the CPU backend.
#[test]
fn new_group_is_not_available_without_a_gpu_or_matches_the_cpu_backend() {
    let count = match NcclComm::device_count() {
        Err(CommError::NotAvailable(msg)) => {
            // Set on a lent GPU machine, where falling back would hide a
            // broken NCCL path.
            assert!(
                std::env::var_os("TANDEM_REQUIRE_GPU").is_none(),
                "TANDEM_REQUIRE_GPU is set but NCCL is not available: {msg}"
            );
            assert!(!msg.is_empty());
            match NcclComm::new_group(&[0]) {
                Err(CommError::NotAvailable(m)) => assert!(!m.is_empty()),
                other => panic!("expected NotAvailable, got {other:?}"),
            }
            return;
        }
        Err(e) => panic!("expected NotAvailable, got {e}"),
        Ok(n) => n,
    };
    let comms = NcclComm::new_group(&(0..count).collect::<Vec<_>>()).unwrap();
    let world = comms.len();
    eprintln!("NCCL group over {world} GPU(s)");
    let handles: Vec<_> = comms
        .into_iter()
        .map(|c| {
            std::thread::spawn(move || {
                let r = c.rank();
                let mut buf: Vec<f32> = (0..1000).map(|i| (i * (r + 1)) as f32).collect();
                c.all_reduce_sum(&mut buf).unwrap();
                let tri = (world * (world + 1) / 2) as f32;
                assert!(buf.iter().enumerate().all(|(i, &x)| x == i as f32 * tri));

                let send = vec![r as f32; 5];
                let mut recv = vec![0.0; 5 * world];
                c.all_gather(&send, &mut recv).unwrap();
                let want: Vec<f32> = (0..world).flat_map(|q| [q as f32; 5]).collect();
                assert_eq!(recv, want);

                let send = vec![1.0; 3 * world];
                let mut recv = vec![0.0; 3];
                c.reduce_scatter_sum(&send, &mut recv).unwrap();
                assert_eq!(recv, vec![world as f32; 3]);

                let counts: Vec<usize> = (0..world).map(|p| (r + p) % 3).collect();
                let send: Vec<f32> = (0..counts.iter().sum::<usize>())
                    .map(|i| (r * 1000 + i) as f32)
                    .collect();
                let (mut recv, mut recv_counts) = (Vec::new(), Vec::new());
                c.all_to_all(&send, &counts, &mut recv, &mut recv_counts)
                    .unwrap();
                let mut want = Vec::new();
                for (q, &got) in recv_counts.iter().enumerate() {
                    let qc: Vec<usize> = (0..world).map(|p| (q + p) % 3).collect();
                    let start: usize = qc[..r].iter().sum();
                    want.extend((start..start + qc[r]).map(|i| (q * 1000 + i) as f32));
                    assert_eq!(got, qc[r]);
                }
                assert_eq!(recv, want);

                let mut wrong = vec![0.0; if r == 0 { 2 } else { 3 }];
                if world > 1 {
                    assert!(matches!(
                        c.all_reduce_sum(&mut wrong),
                        Err(CommError::SizeMismatch { .. })
                    ));
                }
                c.barrier().unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}
