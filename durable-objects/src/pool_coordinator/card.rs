//! The pool's time card on its way to the directory: after each probe round, shard 0's
//! coordinator computes the card (`routing_core::pool::Pool::time_card`, a dry run of the
//! acquire's pricing) and this file pushes it to the directory, which lists it with the pool, so
//! every Worker isolate receives it with the pool list it already refreshes in the background. No
//! call on any request's path carries it. (Grants carry the card too: see
//! `routing_core::coordinator::Coordinator::grant_card`.)

use super::PoolCoordinator;
use coordinator_protocol::internal_call::internal_request;
use coordinator_protocol::messages::CardAnswer;
use coordinator_protocol::names::{DIRECTORY_BINDING, DIRECTORY_NAME};
use coordinator_protocol::{ApiError, Route};
use routing_core::region::TimeCard;
use worker::console_error;

impl PoolCoordinator {
    /// Hands this pool's `card` to the directory (a failure is logged).
    pub(super) async fn publish_card(&self, card: TimeCard) {
        let name = self.with(|shard| shard.name.clone());
        let result = async {
            let body =
                serde_json::to_string(&card).map_err(|e| ApiError::internal(e.to_string()))?;
            let stub = self
                .env
                .durable_object(DIRECTORY_BINDING)?
                .id_from_name(DIRECTORY_NAME)?
                .get_stub()?;
            let route = Route::PutCard(name.clone());
            let mut resp = stub
                .fetch_with_request(internal_request(&route, None, Some(body))?)
                .await?;
            let answer: CardAnswer = resp.json().await?;
            Ok::<bool, ApiError>(answer.known)
        }
        .await;
        if let Err(e) = result {
            console_error!("pool {name}: cannot publish its time card: {e}");
        }
    }
}
