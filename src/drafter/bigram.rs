//! A drafter that follows a bigram table.

use crate::draft::{Draft, Drafter, NodeKind, NodeStats, Request};
use crate::error::Result;
use crate::ngram::BigramTable;
use crate::sampling::Dist;
use std::sync::Arc;

/// Drafts by following the table: its most likely successor each step (a point mass), or,
/// with `sample`, a successor drawn from the table's row renormalized over the successors it
/// keeps, reported with exactly that distribution so the review stays exact. Its confidence
/// in a token is the table's probability of the most likely successor.
pub struct BigramDrafter {
    name: String,
    table: Arc<BigramTable>,
    sample: bool,
}

impl BigramDrafter {
    /// A drafter named `name` over `table`, sampling successors if `sample`.
    pub fn new(name: impl Into<String>, table: Arc<BigramTable>, sample: bool) -> Self {
        Self {
            name: name.into(),
            table,
            sample,
        }
    }
}

impl Drafter for BigramDrafter {
    fn name(&self) -> &str {
        &self.name
    }

    fn draft(&mut self, context: &[u32], request: &mut Request) -> Result<Draft> {
        let mut draft = Draft::new();
        let Some(&last) = context.last() else {
            return Ok(draft);
        };
        if !self.sample {
            follow_table(&self.table, last, usize::MAX, request, &mut draft);
            return Ok(draft);
        }
        let mut prev = last;
        loop {
            let (next, probs) = self.table.successors(prev);
            let total: f32 = probs.iter().sum();
            if next.is_empty() || total <= 0.0 || !request.admit(Some(probs[0] / total)) {
                break;
            }
            let q = Dist::Sparse(
                next.iter()
                    .zip(probs)
                    .map(|(&t, &p)| (t, p / total))
                    .collect(),
            );
            prev = q.sample(request.rng());
            draft.push(prev, q);
            if request.ends(prev) {
                break;
            }
        }
        Ok(draft)
    }

    fn stats(&self) -> NodeStats {
        NodeStats::new(&self.name, NodeKind::Bigram)
    }
}

/// Appends the table's most likely successors from `last` to `draft`, at most `limit`, each
/// admitted by `request` with the table's probability as confidence.
pub(crate) fn follow_table(
    table: &BigramTable,
    mut last: u32,
    limit: usize,
    request: &mut Request,
    draft: &mut Draft,
) {
    for _ in 0..limit {
        let (next, probs) = table.successors(last);
        let (Some(&t), Some(&p)) = (next.first(), probs.first()) else {
            break;
        };
        if !request.admit(Some(p)) {
            break;
        }
        draft.push(t, Dist::Point(t));
        if request.ends(t) {
            break;
        }
        last = t;
    }
}
