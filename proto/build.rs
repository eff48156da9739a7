// Generates the gRPC code from proto/*.proto. Needs `protoc` (Debian: protobuf-compiler),
// which .ci/run installs; PROTOC may point at another one.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/locus/metadata/v1/metadata.proto",
        "proto/locus/node/v1/node.proto",
        "proto/csi/v1/csi.proto",
    ];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    // Blob payloads as `bytes::Bytes`: a node slices one read buffer into messages and
    // hands received pieces to its writer without copying them.
    tonic_prost_build::configure()
        .bytes(".locus.node.v1.BlobData.data")
        .bytes(".locus.node.v1.WriteBlobMessage.data")
        .bytes(".locus.node.v1.SmallBlob.data")
        .compile_protos(&protos, &["proto"])?;
    Ok(())
}
