//! The pool's time card on its way to the directory: after each probe round, shard 0's
//! coordinator computes the card (`routing_core::pool::Pool::time_card`, a dry run of the
//! acquire's pricing) and this file pushes it to the directory, which lists it with the pool, so
//! every Worker isolate receives it with the pool list it already refreshes in the background. No
//! call on any request's path carries it. (Grants carry the card too: see
//! `routing_core::coordinator::Coordinator::grant_card`.)

use super::PoolCoordinator;
use crate::call::send;
use coordinator_protocol::call::PutCard;
use coordinator_protocol::names::{DIRECTORY_BINDING, DIRECTORY_NAME};
use coordinator_protocol::ApiError;
use routing_core::region::TimeCard;
use worker::console_error;

impl PoolCoordinator {
    /// Hands this pool's `card` to the directory (a failure is logged).
    pub(super) async fn publish_card(&self, card: TimeCard) {
        let name = self.with(|shard| shard.name.clone());
        let result = async {
            let stub = self
                .env
                .durable_object(DIRECTORY_BINDING)?
                .id_from_name(DIRECTORY_NAME)?
                .get_stub()?;
            let msg = PutCard {
                pool: name.clone(),
                card,
            };
            Ok::<bool, ApiError>(send(&stub, None, &msg).await?.known)
        }
        .await;
        if let Err(e) = result {
            console_error!("pool {name}: cannot publish its time card: {e}");
        }
    }
}
