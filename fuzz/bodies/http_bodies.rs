//! The HTTP bodies anyone who reaches the metadata service's HTTP port sends without a
//! token: kube-scheduler extender requests (`/k8s/filter`, `/k8s/prioritize`) and
//! `/v1/locality` questions. Parsed and bounded, or refused; never a panic.

pub fn run(data: &[u8]) {
    let _ = locus_metadata::k8s::parse(data);
    let _ = locus_metadata::http_api::parse_locality(data);
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = locus_metadata::http_api::parse_selector(s);
    }
}
