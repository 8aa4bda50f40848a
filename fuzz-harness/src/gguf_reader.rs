//! Feeds arbitrary bytes to the GGUF reader.  It must return Ok or Err,
//! never panic, hang, read out of bounds or allocate without bound; when it
//! returns Ok every tensor's data and every metadata getter must work.

use std::sync::Arc;

use tandem_modelfile::gguf::GgufFile;
use tandem_modelfile::storage::Backing;

/// One fuzz input.
pub fn run(data: &[u8]) {
    let Ok(f) = GgufFile::from_backing(Arc::new(Backing::Owned(data.to_vec()))) else {
        return;
    };
    let len = f.backing().len();
    let _ = f.version();
    assert!(f.alignment().is_power_of_two());
    for t in f.tensors() {
        let bytes = f
            .tensor_data(&t.name)
            .expect("tensor data validated at open");
        assert_eq!(bytes.len(), t.n_bytes());
        let r = f.tensor_range(t);
        assert!(r.start <= r.end && r.end <= len);
        assert_eq!(r.start % f.alignment(), 0);
        assert!(t.n_elements() > 0);
        let _ = (t.ty.name(), t.ty.block_len(), t.ty.block_bytes());
        // Touch the first and last byte so that a bad range would fault.
        std::hint::black_box((bytes.first(), bytes.last()));
    }
    for (key, value) in f.metadata() {
        assert!(f.get(key).is_some());
        let _ = value.type_name();
        let _ = f.get_u32(key).map_err(|e| e.to_string());
        let _ = f.get_f32(key).map_err(|e| e.to_string());
        let _ = f.get_bool(key).map_err(|e| e.to_string());
        let _ = f.get_str(key).map_err(|e| e.to_string());
        let _ = f.get_str_array(key).map_err(|e| e.to_string());
        let _ = f.get_i32_array(key).map_err(|e| e.to_string());
        let _ = f.get_f32_array(key).map_err(|e| e.to_string());
    }
    let _ = f.tensor("no.such.tensor").map_err(|e| e.to_string());
    let _ = format!("{f:?}");
}
