//! Image URLs, fetched only with `serve --image-fetch`: `http` and `https`,
//! no proxy, each redirect followed by hand and checked like the first URL,
//! every address checked after DNS resolution (the connection goes to a
//! checked address, so a name cannot resolve to another one later), the
//! declared and the streamed size stopped at the limits, and all of a
//! request's fetches within one timeout.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ipnet::IpNet;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::Url;

use super::load::{check_bytes, Pending};
use super::{FetchConfig, ImageLimits};

/// Which addresses may be fetched from: none that is loopback, private,
/// link-local, multicast, unspecified (or otherwise not public, see
/// [`forbidden`]), unless an `--image-fetch-allow` range holds it.
#[derive(Clone, Debug, Default)]
pub struct AddressPolicy {
    pub allow: Vec<IpNet>,
}

impl AddressPolicy {
    pub fn permits(&self, ip: IpAddr) -> bool {
        self.allow.iter().any(|net| net.contains(&ip)) || !forbidden(ip)
    }
}

/// Addresses that are not the public internet.
pub fn forbidden(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return forbidden_v4(v4);
            }
            let s = v6.segments();
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00 // unique local fc00::/7
                || (s[0] & 0xffc0) == 0xfe80 // link-local fe80::/10
                || (s[0] & 0xffc0) == 0xfec0 // site-local fec0::/10
                || (s[0] == 0x64 && s[1] == 0xff9b) // NAT64 64:ff9b::/96 reaches IPv4 space
                || (s[0] == 0x2001 && s[1] == 0x0db8) // documentation
                || (s[0..6] == [0, 0, 0, 0, 0, 0]) // IPv4-compatible ::a.b.c.d
        }
    }
}

fn forbidden_v4(ip: Ipv4Addr) -> bool {
    let o = ip.octets();
    ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_multicast()
        || ip.is_unspecified()
        || ip.is_broadcast()
        || ip.is_documentation()
        || o[0] == 0 // "this network"
        || (o[0] == 100 && (o[1] & 0xc0) == 64) // shared address space 100.64.0.0/10
        || (o[0] == 192 && o[1] == 0 && o[2] == 0) // IETF protocol assignments
        || (o[0] == 198 && (o[1] & 0xfe) == 18) // benchmarking 198.18.0.0/15
        || o[0] >= 240 // reserved
}

/// Resolves names and keeps only the addresses the policy permits.
struct CheckedResolver {
    policy: Arc<AddressPolicy>,
}

#[derive(Debug)]
struct Refused(String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

impl Resolve for CheckedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let policy = self.policy.clone();
        Box::pin(async move {
            let host = name.as_str().to_string();
            let all: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let permitted: Vec<SocketAddr> = all.iter().copied().filter(|a| policy.permits(a.ip())).collect();
            if permitted.is_empty() {
                let ips: Vec<String> = all.iter().map(|a| a.ip().to_string()).collect();
                let why = format!("`{host}` resolves to {}, which this server does not fetch from", ips.join(", "));
                return Err(Box::new(Refused(why)) as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(permitted.into_iter()) as Addrs)
        })
    }
}

/// The server's image fetcher.
pub struct Fetcher {
    client: reqwest::Client,
    policy: Arc<AddressPolicy>,
    config: FetchConfig,
}

impl Fetcher {
    pub fn new(config: &FetchConfig) -> anyhow::Result<Self> {
        let policy = Arc::new(AddressPolicy { allow: config.allow.clone() });
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .dns_resolver(Arc::new(CheckedResolver { policy: policy.clone() }))
            .connect_timeout(config.timeout)
            .timeout(config.timeout)
            .user_agent(concat!("deepinfer/", env!("CARGO_PKG_VERSION"), " (image fetch)"))
            .build()?;
        Ok(Self { client, policy, config: config.clone() })
    }

    /// Fetch every pending image that has a URL, all together within the timeout;
    /// `used` counts the request's image bytes so far (its data URLs').
    pub async fn fetch_all(&self, pending: &mut [Pending], limits: &ImageLimits) -> Result<(), String> {
        let used = AtomicUsize::new(pending.iter().map(|p| p.bytes.len()).sum());
        let timeout = self.config.timeout;
        let jobs =
            pending.iter().filter_map(|p| p.url.as_deref().map(|url| (p.path.as_str(), url))).map(|(path, url)| {
                let used = &used;
                async move {
                    match tokio::time::timeout(timeout, self.fetch(path, url, limits, used)).await {
                        Ok(result) => result,
                        Err(_) => Err(format!(
                            "`{path}`: fetching the image took longer than {} ms (the limit)",
                            timeout.as_millis()
                        )),
                    }
                }
            });
        let fetched = futures_util::future::join_all(jobs).await;
        let mut fetched = fetched.into_iter();
        for p in pending.iter_mut().filter(|p| p.url.is_some()) {
            p.bytes = fetched.next().expect("one result per URL")?;
        }
        Ok(())
    }

    async fn fetch(&self, path: &str, url: &str, limits: &ImageLimits, used: &AtomicUsize) -> Result<Vec<u8>, String> {
        let mut url = Url::parse(url).map_err(|e| format!("`{path}`: the image URL is not a valid URL: {e}"))?;
        let mut redirects = 0;
        loop {
            self.check(path, &url)?;
            let mut response = self
                .client
                .get(url.clone())
                .send()
                .await
                .map_err(|e| format!("`{path}`: {}", chain(&e, &url, self.config.timeout)))?;
            let status = response.status();
            if matches!(status.as_u16(), 301 | 302 | 303 | 307 | 308) {
                if redirects == self.config.max_redirects {
                    return Err(format!(
                        "`{path}`: the image URL redirects more than {} times (the limit)",
                        self.config.max_redirects
                    ));
                }
                redirects += 1;
                let location = response.headers().get(reqwest::header::LOCATION).and_then(|v| v.to_str().ok());
                let location = location.ok_or_else(|| format!("`{path}`: a redirect from {url} without a Location"))?;
                url = url.join(location).map_err(|e| format!("`{path}`: a redirect to an invalid URL: {e}"))?;
                continue;
            }
            if !status.is_success() {
                return Err(format!("`{path}`: fetching {url} was answered {status}"));
            }
            if let Some(n) = response.content_length() {
                check_bytes(path, usize::try_from(n).unwrap_or(usize::MAX), 0, limits)?;
            }
            let mut body = Vec::new();
            while let Some(chunk) =
                response.chunk().await.map_err(|e| format!("`{path}`: {}", chain(&e, &url, self.config.timeout)))?
            {
                check_bytes(path, body.len() + chunk.len(), 0, limits)?;
                let before = used.fetch_add(chunk.len(), Ordering::Relaxed);
                check_bytes(path, 0, before + chunk.len(), limits)?;
                body.extend_from_slice(&chunk);
            }
            return Ok(body);
        }
    }

    /// The scheme, and an address given as such (a name's are checked when it resolves).
    fn check(&self, path: &str, url: &Url) -> Result<(), String> {
        if !matches!(url.scheme(), "http" | "https") {
            return Err(format!("`{path}`: only http and https image URLs are fetched, not {}:", url.scheme()));
        }
        let host = url.host_str().ok_or_else(|| format!("`{path}`: the image URL {url} has no host"))?;
        let Ok(ip) = host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() else { return Ok(()) };
        match self.policy.permits(ip) {
            true => Ok(()),
            false => Err(format!("`{path}`: {ip} is an address this server does not fetch from")),
        }
    }
}

/// A fetch error with its causes, the policy's refusal first when it is one.
fn chain(e: &reqwest::Error, url: &Url, timeout: std::time::Duration) -> String {
    let mut source: Option<&dyn std::error::Error> = Some(e);
    let mut causes = Vec::new();
    while let Some(s) = source {
        if let Some(refused) = s.downcast_ref::<Refused>() {
            return refused.0.clone();
        }
        causes.push(s.to_string());
        source = s.source();
    }
    if e.is_timeout() {
        return format!("fetching {url} took longer than {} ms (the limit)", timeout.as_millis());
    }
    format!("cannot fetch {url}: {}", causes.join(": "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn private_and_special_addresses_are_forbidden_unless_allowed() {
        for a in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "224.0.0.1",
            "0.0.0.0",
            "255.255.255.255",
            "100.64.0.1",
            "::1",
            "::",
            "fc00::1",
            "fe80::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "64:ff9b::a00:1",
        ] {
            assert!(forbidden(ip(a)), "{a}");
        }
        for a in ["93.184.216.34", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"] {
            assert!(!forbidden(ip(a)), "{a}");
        }
        let policy = AddressPolicy { allow: vec!["127.0.0.1/32".parse().unwrap()] };
        assert!(policy.permits(ip("127.0.0.1")));
        assert!(!policy.permits(ip("127.0.0.2")));
        assert!(!policy.permits(ip("10.0.0.1")));
    }
}
