fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/tandem.proto");
    tonic_prost_build::configure().compile_protos(&["proto/tandem.proto"], &["proto"])?;
    Ok(())
}
