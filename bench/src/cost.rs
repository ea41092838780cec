//! What a load and a save cost at object storage's list prices: the one price table behind
//! every benchmark's cost columns (`transfer`, `traffic`).
//!
//! A load is billed per request (a gather request, a ranged GET or a HEAD of a lookup are
//! each one GET-class request) and per byte moved out of the store's region; a save per PUT;
//! what the store holds per GB-month. Reads of the embedded file store are not billed.

use serde::Serialize;

/// List prices of one object storage offer, USD.
#[derive(Debug, Clone, Copy)]
pub struct Prices {
    /// What the table is: offer, region, and where the figures come from.
    pub name: &'static str,
    /// 1,000 GET-class requests (GET, HEAD, ranged GET).
    pub get_per_1000: f64,
    /// 1,000 PUT-class requests (PUT, COPY, POST, LIST).
    pub put_per_1000: f64,
    /// One GB (10^9 bytes) stored for a month.
    pub storage_per_gb_month: f64,
    /// One GB moved to a server in the store's region: free on S3.
    pub transfer_in_region_per_gb: f64,
    /// One GB moved to another region of the same provider.
    pub transfer_cross_region_per_gb: f64,
}

/// AWS S3 Standard, us-east-1, first pricing tier, as listed on
/// <https://aws.amazon.com/s3/pricing/>: $0.0004 per 1,000 GETs, $0.005 per 1,000 PUTs,
/// $0.023 per GB-month, data transfer to EC2 in the same region free, to another AWS region
/// $0.02 per GB. These list prices have stood unchanged for years; check the page before
/// quoting a dollar figure.
pub const S3_STANDARD: Prices = Prices {
    name: "AWS S3 Standard, us-east-1 list prices (aws.amazon.com/s3/pricing)",
    get_per_1000: 0.0004,
    put_per_1000: 0.005,
    storage_per_gb_month: 0.023,
    transfer_in_region_per_gb: 0.0,
    transfer_cross_region_per_gb: 0.02,
};

/// What one load and one save of a prefix cost (JSON fields of the benchmarks' records).
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Cost {
    /// One load read from the store's region: its requests and bytes, USD.
    pub cost_usd_per_load: f64,
    /// `cost_usd_per_load` x 1,000.
    pub cost_usd_per_1k_loads: f64,
    /// One load by a server in another region: its requests plus its bytes at the
    /// cross-region transfer price, USD.
    pub cost_usd_per_load_cross_region: f64,
    /// 1,000 saves of the prefix: their PUTs, USD.
    pub cost_usd_per_1k_saves: f64,
    /// Keeping the prefix's objects for a month, USD.
    pub storage_usd_per_month: f64,
}

impl Prices {
    /// The cost of a load of `requests` requests moving `bytes` bytes, of a save of `puts`
    /// PUTs, and of storing `stored_bytes` bytes. `billed = false` (the embedded file store:
    /// local reads and writes) costs nothing.
    pub fn cost(
        &self,
        billed: bool,
        requests: u64,
        bytes: u64,
        puts: u64,
        stored_bytes: u64,
    ) -> Cost {
        if !billed {
            return Cost::default();
        }
        let gb = |b: u64| b as f64 / 1e9;
        let req = requests as f64 * self.get_per_1000 / 1000.0;
        let load = req + gb(bytes) * self.transfer_in_region_per_gb;
        Cost {
            cost_usd_per_load: load,
            cost_usd_per_1k_loads: load * 1000.0,
            cost_usd_per_load_cross_region: req + gb(bytes) * self.transfer_cross_region_per_gb,
            cost_usd_per_1k_saves: puts as f64 * self.put_per_1000,
            storage_usd_per_month: gb(stored_bytes) * self.storage_per_gb_month,
        }
    }
}

impl Cost {
    /// The load figures of a [`Prices::cost`] taken over the requests and bytes of `loads`
    /// loads together, per load (saves and storage unchanged).
    pub fn averaged_over(mut self, loads: u64) -> Cost {
        let n = loads.max(1) as f64;
        self.cost_usd_per_load /= n;
        self.cost_usd_per_1k_loads /= n;
        self.cost_usd_per_load_cross_region /= n;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gather_load_of_one_gib_costs_one_request_in_region() {
        let c = S3_STANDARD.cost(true, 1, 1 << 30, 64, 1 << 30);
        assert_eq!(c.cost_usd_per_load, 0.0004 / 1000.0);
        assert!((c.cost_usd_per_1k_loads - 0.0004).abs() < 1e-12);
        // 1 GiB = 1.0737 GB at $0.02
        assert!((c.cost_usd_per_load_cross_region - (4e-7 + 0.021_474_836_48)).abs() < 1e-9);
        assert!((c.cost_usd_per_1k_saves - 0.32).abs() < 1e-12);
        assert!((c.storage_usd_per_month - 0.024_696_061_31).abs() < 1e-9);
        assert_eq!(S3_STANDARD.cost(false, 9, 9, 9, 9), Cost::default());
        let two = S3_STANDARD
            .cost(true, 2, 2 << 30, 64, 1 << 30)
            .averaged_over(2);
        assert!((two.cost_usd_per_load - c.cost_usd_per_load).abs() < 1e-15);
        assert!(
            (two.cost_usd_per_load_cross_region - c.cost_usd_per_load_cross_region).abs() < 1e-12
        );
        assert_eq!(two.storage_usd_per_month, c.storage_usd_per_month);
    }
}
