use super::*;

fn fp() -> ModelFingerprint {
    ModelFingerprint {
        model_id: "m".into(),
        weights_hash: 0xabc,
        kv_dtype: "f16".into(),
        block_size: 16,
        kv_layout: "layer/kv/head/slot/dim".into(),
        num_layers: 2,
        num_kv_heads: 3,
        head_dim: 4,
    }
}

fn prefill_req() -> pb::PrefillRequest {
    pb::PrefillRequest {
        version: PROTOCOL_VERSION,
        fingerprint: Some((&fp()).into()),
        prompt: vec![1; 40],
        sampling: Some(
            (&SamplingParams {
                logit_bias: vec![(2, -5.0), (9, 3.5)],
                min_tokens: Some(MinTokens {
                    count: 3,
                    stop_ids: vec![0, 2],
                }),
                ..SamplingParams::greedy()
            })
                .into(),
        ),
        skip_blocks: 1,
        dst_blocks: vec![7, 9],
        constraint: None,
        region: Some(pb::KvRegion {
            worker_address: vec![1, 2],
            grant: vec![3],
            len: 10 * 1000,
            connector: "ucx".into(),
        }),
        deadline_ms: 5000,
        rank_regions: vec![],
    }
}

fn rejected(req: pb::PrefillRequest) -> String {
    PrefillJob::validate(req, &fp(), 1000)
        .expect_err("must be rejected")
        .to_string()
}

#[test]
fn prefill_request_round_trips() {
    let job = PrefillJob::validate(prefill_req(), &fp(), 1000).expect("valid");
    assert_eq!(job.dst_blocks, vec![7, 9]);
    assert_eq!(job.skip_blocks, 1);
    assert_eq!(job.deadline, Duration::from_secs(5));
    assert_eq!(job.sampling.logit_bias, vec![(2, -5.0), (9, 3.5)]);
    assert_eq!(job.sampling.min_tokens.as_ref().map(|m| m.count), Some(3));
    let again = PrefillJob::validate(job.to_pb(&fp()), &fp(), 1000).expect("valid");
    assert_eq!(again, job);
}

#[test]
fn prefill_request_rejections_name_the_problem() {
    let mut r = prefill_req();
    r.version = 99;
    assert!(rejected(r).contains("protocol version 99"));

    let mut r = prefill_req();
    r.fingerprint = Some(
        (&ModelFingerprint {
            block_size: 32,
            ..fp()
        })
            .into(),
    );
    assert_eq!(
        rejected(r),
        "incompatible peer: KV block size differs: ours 16, peer's 32"
    );

    let mut r = prefill_req();
    r.dst_blocks = vec![7, 10];
    assert!(rejected(r).contains("block 10 lies outside the registered region of 10 blocks"));

    let mut r = prefill_req();
    r.dst_blocks = vec![7];
    assert!(rejected(r).contains("do not cover a prompt of 40 tokens"));

    let mut r = prefill_req();
    r.skip_blocks = 9;
    assert!(rejected(r).contains("dst_blocks"));

    // A tensor-parallel decode node's ranks must split the KV heads evenly:
    // 2 ranks cannot hold 3 heads (the handshake names it).
    let mut r = prefill_req();
    r.rank_regions = vec![r.region.clone().expect("region")];
    assert!(rejected(r).contains("2 decode ranks do not divide 3 KV heads"));
    // 3 ranks can: each rank's pool holds a third of a block.
    let mut r = prefill_req();
    let region = r.region.clone().expect("region");
    r.rank_regions = vec![region.clone(), region];
    let job = PrefillJob::validate(r, &fp(), 3000).expect("3 ranks of 1 head");
    assert_eq!(job.regions.len(), 3);

    let mut r = prefill_req();
    r.deadline_ms = 0;
    assert!(rejected(r).contains("deadline_ms"));

    let mut r = prefill_req();
    r.region = None;
    assert!(rejected(r).contains("region"));

    let mut r = prefill_req();
    if let Some(reg) = r.region.as_mut() {
        reg.grant.clear();
    }
    assert!(rejected(r).contains("grant"));

    let mut r = prefill_req();
    r.prompt.clear();
    assert!(rejected(r).contains("prompt"));

    let mut r = prefill_req();
    r.sampling = Some(pb::SamplingParams {
        temperature: -1.0,
        ..(&SamplingParams::greedy()).into()
    });
    assert!(rejected(r).contains("sampling"));

    // A bias list out of order (the engine relies on one entry per token).
    let mut r = prefill_req();
    if let Some(s) = r.sampling.as_mut() {
        s.logit_bias.reverse();
    }
    assert!(rejected(r).contains("logit_bias"));

    let mut r = prefill_req();
    if let Some(f) = r.fingerprint.as_mut() {
        f.weights_hash = "zz".into();
    }
    assert!(rejected(r).contains("weights_hash"));
}

#[test]
fn generate_request_validation() {
    let job = GenerateJob {
        request: GenerationRequest {
            prompt: vec![1, 2, 3],
            sampling: SamplingParams::greedy(),
            max_tokens: 5,
            stop_token_ids: vec![2],
            constraint: Some(Constraint::JsonSchema(r#"{"type":"integer"}"#.into())),
        },
        prefill: vec![PrefillTarget {
            worker_id: "p0".into(),
            endpoint: "http://127.0.0.1:5000".into(),
        }],
        prefix_source: None,
    };
    let back = GenerateJob::validate(job.to_pb(&fp()), &fp()).expect("valid");
    assert_eq!(back, job);
    // Every kind of constraint crosses the wire unchanged.
    for c in [
        Constraint::JsonObject,
        Constraint::Regex("[0-9]+".into()),
        Constraint::Lark("start: \"a\"".into()),
    ] {
        let mut j = job.clone();
        j.request.constraint = Some(c);
        assert_eq!(
            GenerateJob::validate(j.to_pb(&fp()), &fp()).expect("valid"),
            j
        );
    }
    let mut r = job.to_pb(&fp());
    r.constraint = Some(pb::Constraint {
        kind: Some(pb::constraint::Kind::Regex(
            "x".repeat(MAX_CONSTRAINT_BYTES + 1),
        )),
    });
    assert!(GenerateJob::validate(r, &fp()).is_err());

    for bad in [
        "127.0.0.1:5000",
        "http://:5000",
        "http://host",
        "http://h:0",
        "http://h:x",
        "https://h:0",
        "ftp://h:1",
    ] {
        let mut r = job.to_pb(&fp());
        r.prefill[0].endpoint = bad.into();
        let e = GenerateJob::validate(r, &fp()).expect_err(bad);
        assert!(e.to_string().contains("endpoint"), "{bad}: {e}");
    }
    for good in ["http://h:1", "https://h:1"] {
        let mut r = job.to_pb(&fp());
        r.prefill[0].endpoint = good.into();
        assert!(GenerateJob::validate(r, &fp()).is_ok(), "{good}");
    }
    let mut r = job.to_pb(&fp());
    r.max_tokens = 0;
    assert!(GenerateJob::validate(r, &fp()).is_err());
    let mut r = job.to_pb(&fp());
    r.fingerprint = None;
    assert!(GenerateJob::validate(r, &fp()).is_err());
}

#[test]
fn prefix_source_is_checked_against_the_prompt() {
    let mut job = GenerateJob::validate(
        pb::GenerateRequest {
            version: PROTOCOL_VERSION,
            fingerprint: Some((&fp()).into()),
            prompt: vec![1; 40],
            sampling: Some((&SamplingParams::greedy()).into()),
            max_tokens: 4,
            ..Default::default()
        },
        &fp(),
    )
    .expect("valid");
    job.prefix_source = Some(PrefixSource {
        worker_id: "d1".into(),
        endpoint: "http://h:7".into(),
        blocks: 2,
    });
    let back = GenerateJob::validate(job.to_pb(&fp()), &fp()).expect("valid");
    assert_eq!(back, job);
    // 40 tokens are two full blocks of 16: a third is not the prompt's.
    for (blocks, endpoint, field) in [
        (3, "http://h:7", "prefix_source.blocks"),
        (0, "http://h:7", "prefix_source.blocks"),
        (1, "h:7", "prefix_source.endpoint"),
    ] {
        let mut r = job.to_pb(&fp());
        let p = r.prefix_source.as_mut().expect("set");
        p.blocks = blocks;
        p.endpoint = endpoint.into();
        let e = GenerateJob::validate(r, &fp()).expect_err(field);
        assert!(e.to_string().contains(field), "{field}: {e}");
    }
}

fn fetch_req() -> pb::FetchRequest {
    let p = prefill_req();
    pb::FetchRequest {
        version: PROTOCOL_VERSION,
        fingerprint: p.fingerprint,
        prompt: vec![5; 48],
        skip_blocks: 1,
        dst_blocks: vec![7, 9],
        region: p.region,
        rank_regions: vec![],
        deadline_ms: 5000,
    }
}

#[test]
fn fetch_request_round_trips_and_rejections_name_the_problem() {
    let job = FetchJob::validate(fetch_req(), &fp(), 1000).expect("valid");
    assert_eq!((job.skip_blocks, job.dst_blocks.clone()), (1, vec![7, 9]));
    let again = FetchJob::validate(job.to_pb(&fp()), &fp(), 1000).expect("valid");
    assert_eq!(again, job);
    type Break = fn(&mut pb::FetchRequest);
    let cases: [(Break, &str); 7] = [
        // The prompt must be exactly the blocks up to the last one asked.
        (|r| r.prompt.push(1), "dst_blocks"),
        (|r| r.skip_blocks = 2, "dst_blocks"),
        (|r| r.dst_blocks.clear(), "dst_blocks"),
        (|r| r.skip_blocks = u32::MAX, "dst_blocks"),
        // Block 10 of a 10-block region.
        (|r| r.dst_blocks[1] = 10, "outside the registered region"),
        (|r| r.deadline_ms = 0, "deadline_ms"),
        (|r| r.region = None, "region"),
    ];
    for (break_it, says) in cases {
        let mut r = fetch_req();
        break_it(&mut r);
        let e = FetchJob::validate(r, &fp(), 1000)
            .expect_err(says)
            .to_string();
        assert!(e.contains(says), "{says}: {e}");
    }
    let mut r = fetch_req();
    r.fingerprint = Some(pb::Fingerprint {
        num_layers: 9,
        ..(&fp()).into()
    });
    assert!(matches!(
        FetchJob::validate(r, &fp(), 1000),
        Err(ProtoError::Fingerprint(_))
    ));
}

#[test]
fn tokens_and_finish_reasons() {
    let s = Sampled {
        token: 5,
        logprob: Some(-0.5),
        top: vec![(5, -0.5), (6, -1.0)],
    };
    assert_eq!(Sampled::try_from(pb::Token::from(&s)), Ok(s));
    let bad = pb::Token {
        id: 1,
        logprob: Some(0.5),
        top: vec![],
    };
    assert!(Sampled::try_from(bad).is_err());
    assert_eq!(
        finish_from_pb(finish_to_pb(FinishReason::Length) as i32),
        Ok(FinishReason::Length)
    );
    assert!(finish_from_pb(0).is_err());
    assert!(finish_from_pb(77).is_err());
}

#[test]
fn worker_records_round_trip_and_garbage_is_rejected() {
    let rec = WorkerRecord {
        id: "d0".into(),
        role: ROLE_DECODE.into(),
        grpc_endpoint: "http://127.0.0.1:7000".into(),
        metrics_endpoint: "http://127.0.0.1:7001".into(),
        fingerprint: fp(),
        kv_blocks_total: 100,
        max_batch_size: 8,
        tp: 1,
        dp: 1,
    };
    assert_eq!(WorkerRecord::decode(&rec.encode()), Ok(rec.clone()));
    assert!(WorkerRecord::decode(b"\xff\xff\xff garbage").is_err());
    assert!(WorkerRecord::decode(&[]).is_err());
    let odd = WorkerRecord {
        role: "chef".into(),
        ..rec
    };
    assert!(WorkerRecord::decode(&odd.encode()).is_err());
}

#[test]
fn a_call_cut_by_a_broken_connection_is_unavailable() {
    let reset = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
    let s = tonic::Status::from_error(Box::new(reset));
    assert_eq!(s.code(), tonic::Code::Unknown);
    assert!(matches!(
        failure_from_status(&s),
        GenFailure::Unavailable(_)
    ));
    // The same code without a transport cause stays a fault of the node.
    let s = tonic::Status::unknown("node bug");
    assert!(matches!(failure_from_status(&s), GenFailure::Internal(_)));
}
