//! The cluster's certificates: one CA, one certificate per node (its name as
//! DNS subject) and one for clients (`client`). Every QUIC connection is
//! mutual TLS 1.3 against the CA: a peer whose certificate the CA did not
//! sign never completes the handshake.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// The name client certificates carry.
pub const CLIENT_NAME: &str = "client";
/// ALPN of the cluster protocol (tracks the wire version).
pub const ALPN: &[u8] = b"deepinfer/7";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {why}")]
    File { path: PathBuf, why: String },
    #[error("certificate generation: {0}")]
    Generate(String),
    #[error("TLS configuration: {0}")]
    Config(String),
    #[error("`{0}` is not a valid certificate name (letters, digits, '-', '.')")]
    BadName(String),
}

/// A member's credentials: the cluster CA, its certificate and key.
pub struct Identity {
    pub ca: CertificateDer<'static>,
    pub cert: CertificateDer<'static>,
    pub key: PrivateKeyDer<'static>,
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Self { ca: self.ca.clone(), cert: self.cert.clone(), key: self.key.clone_key() }
    }
}

fn check_name(name: &str) -> Result<(), TlsError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
        && ServerName::try_from(name.to_string()).is_ok();
    if ok {
        Ok(())
    } else {
        Err(TlsError::BadName(name.to_string()))
    }
}

fn gen(e: rcgen::Error) -> TlsError {
    TlsError::Generate(e.to_string())
}

/// A freshly generated CA and its signing half.
pub struct Ca {
    pub cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
    der: CertificateDer<'static>,
}

impl Ca {
    pub fn generate(cluster: &str) -> Result<Self, TlsError> {
        let key = KeyPair::generate().map_err(gen)?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(gen)?;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, format!("deepinfer cluster CA ({cluster})"));
        params.distinguished_name = dn;
        let cert = params.self_signed(&key).map_err(gen)?;
        Ok(Self { cert_pem: cert.pem(), der: cert.der().clone(), issuer: Issuer::new(params, key) })
    }

    /// A certificate for `name` (a node name or [`CLIENT_NAME`]), valid for TLS server and client use.
    pub fn issue(&self, name: &str) -> Result<Identity, TlsError> {
        let (cert, key) = self.issue_raw(name)?;
        let key = PrivateKeyDer::try_from(key.serialize_der()).map_err(|e| TlsError::Generate(e.to_string()))?;
        Ok(Identity { ca: self.der.clone(), cert: cert.der().clone(), key })
    }

    /// [`Ca::issue`] as PEM text: certificate, private key.
    pub fn issue_pem(&self, name: &str) -> Result<(String, String), TlsError> {
        let (cert, key) = self.issue_raw(name)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    fn issue_raw(&self, name: &str) -> Result<(rcgen::Certificate, KeyPair), TlsError> {
        check_name(name)?;
        let key = KeyPair::generate().map_err(gen)?;
        let mut params = CertificateParams::new(vec![name.to_string()]).map_err(gen)?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages =
            vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &self.issuer).map_err(gen)?;
        Ok((cert, key))
    }
}

fn write(path: &Path, text: &str, private: bool) -> Result<(), TlsError> {
    let err = |e: std::io::Error| TlsError::File { path: path.to_path_buf(), why: e.to_string() };
    #[cfg(unix)]
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(if private { 0o600 } else { 0o644 })
            .open(path)
            .map_err(err)?;
        f.write_all(text.as_bytes()).map_err(err)
    }
    #[cfg(not(unix))]
    {
        let _ = private;
        std::fs::write(path, text).map_err(err)
    }
}

/// Write a new CA (`ca.pem`) and `<name>.pem` / `<name>.key` for every name
/// into `dir`. The CA's key is not kept: adding a member means issuing
/// every certificate again.
pub fn write_cluster_certs(dir: &Path, cluster: &str, names: &[String]) -> Result<Vec<PathBuf>, TlsError> {
    for n in names {
        check_name(n)?;
    }
    std::fs::create_dir_all(dir).map_err(|e| TlsError::File { path: dir.to_path_buf(), why: e.to_string() })?;
    let ca = Ca::generate(cluster)?;
    let mut written = vec![dir.join("ca.pem")];
    write(&written[0], &ca.cert_pem, false)?;
    for name in names {
        let (cert_pem, key_pem) = ca.issue_pem(name)?;
        let (cert, key) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
        write(&cert, &cert_pem, false)?;
        write(&key, &key_pem, true)?;
        written.extend([cert, key]);
    }
    Ok(written)
}

/// Load `ca.pem`, `<name>.pem` and `<name>.key` from `dir`.
pub fn load_identity(dir: &Path, name: &str) -> Result<Identity, TlsError> {
    let cert_of =
        |path: PathBuf| CertificateDer::from_pem_file(&path).map_err(|e| TlsError::File { path, why: e.to_string() });
    let ca = cert_of(dir.join("ca.pem"))?;
    let cert = cert_of(dir.join(format!("{name}.pem")))?;
    let key_path = dir.join(format!("{name}.key"));
    let key =
        PrivateKeyDer::from_pem_file(&key_path).map_err(|e| TlsError::File { path: key_path, why: e.to_string() })?;
    Ok(Identity { ca, cert, key })
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(id: &Identity) -> Result<Arc<rustls::RootCertStore>, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(id.ca.clone()).map_err(|e| TlsError::Config(format!("cluster CA: {e}")))?;
    Ok(Arc::new(roots))
}

fn cfg(e: impl std::fmt::Display) -> TlsError {
    TlsError::Config(e.to_string())
}

/// Accepting side: TLS 1.3, a client certificate signed by the CA is required.
pub fn server_config(id: &Identity) -> Result<rustls::ServerConfig, TlsError> {
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots(id)?, provider()).build().map_err(cfg)?;
    let mut c = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(cfg)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![id.cert.clone()], id.key.clone_key())
        .map_err(cfg)?;
    c.alpn_protocols = vec![ALPN.to_vec()];
    Ok(c)
}

/// Dialing side: the server must hold a CA-signed certificate for the name dialed; we present ours.
pub fn client_config(id: &Identity) -> Result<rustls::ClientConfig, TlsError> {
    let mut c = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(cfg)?
        .with_root_certificates(roots(id)?)
        .with_client_auth_cert(vec![id.cert.clone()], id.key.clone_key())
        .map_err(cfg)?;
    c.alpn_protocols = vec![ALPN.to_vec()];
    Ok(c)
}

/// Whether a (CA-verified) end-entity certificate names `name`.
pub fn cert_names(cert: &CertificateDer<'_>, name: &str) -> bool {
    let Ok(ee) = webpki::EndEntityCert::try_from(cert) else { return false };
    let Ok(server_name) = ServerName::try_from(name) else { return false };
    ee.verify_is_valid_for_subject_name(&server_name).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificates_round_trip_through_files_and_name_their_holder() {
        let dir = std::env::temp_dir().join(format!("deepinfer-tls-{}", std::process::id()));
        let names = vec!["node0".to_string(), CLIENT_NAME.to_string()];
        write_cluster_certs(&dir, "t", &names).unwrap();
        let id = load_identity(&dir, "node0").unwrap();
        assert!(cert_names(&id.cert, "node0"));
        assert!(!cert_names(&id.cert, "node1"));
        server_config(&id).unwrap();
        client_config(&load_identity(&dir, CLIENT_NAME).unwrap()).unwrap();
        assert!(matches!(write_cluster_certs(&dir, "t", &["../x".into()]), Err(TlsError::BadName(_))));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
