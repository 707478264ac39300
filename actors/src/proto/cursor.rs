//! The output cursor, one rule for every hop that relays a request's
//! tokens (router → client, scheduler → router): an output item carries
//! the index of its first token, so a receiver holding `have` tokens can
//! tell new tokens from repeats and see a gap.

/// Where an item of `len` tokens starting at token `from` stands against
/// the `have` tokens a receiver holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fit {
    /// Tokens `have..from` were lost on the way: ask for them again.
    Gap,
    /// Everything in it was already received (a duplicate or a late resend).
    Stale,
    /// Its tokens from `skip` on are new (none when it only carries an end).
    New { skip: usize },
}

pub fn fit(have: usize, from: usize, len: usize) -> Fit {
    if from > have {
        return Fit::Gap;
    }
    let skip = have - from;
    if skip > len {
        Fit::Stale
    } else {
        Fit::New { skip }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_tokens_repeats_and_gaps() {
        assert_eq!(fit(0, 0, 2), Fit::New { skip: 0 });
        assert_eq!(fit(2, 1, 2), Fit::New { skip: 1 }, "an overlap: only the last is new");
        assert_eq!(fit(2, 0, 2), Fit::New { skip: 2 }, "nothing new, but an end it carries still counts");
        assert_eq!(fit(3, 0, 2), Fit::Stale);
        assert_eq!(fit(2, 3, 1), Fit::Gap);
    }
}
