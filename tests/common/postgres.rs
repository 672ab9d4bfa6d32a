//! A fresh PostgreSQL database per test, on the server `scripts/services.sh` starts.

use std::time::Duration;

/// A database where the test role may create databases; `FORGEPOOL_TEST_POSTGRES_URL`
/// overrides it.
pub fn admin_url() -> String {
    std::env::var("FORGEPOOL_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://forgepool:forgepool@127.0.0.1:5432/forgepool".into())
}

/// A database made for one test, dropped by [`TestDatabase::drop_database`].
pub struct TestDatabase {
    pub name: String,
    pub url: String,
}

async fn admin() -> tokio_postgres::Client {
    let url = admin_url();
    let connect = tokio_postgres::connect(&url, tokio_postgres::NoTls);
    let (client, connection) = match tokio::time::timeout(Duration::from_secs(5), connect).await {
        Ok(Ok(pair)) => pair,
        Ok(Err(error)) => panic!("PostgreSQL is not reachable at {url} ({error}): start it with `scripts/services.sh` (or set FORGEPOOL_TEST_POSTGRES_URL) and run the tests again"),
        Err(_) => panic!("PostgreSQL at {url} did not answer within 5 s: start it with `scripts/services.sh` and run the tests again"),
    };
    tokio::spawn(connection);
    client
}

impl TestDatabase {
    /// Creates an empty database with a unique name.
    pub async fn create() -> TestDatabase {
        let name = format!("fpt_{}", uuid::Uuid::new_v4().simple());
        admin()
            .await
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .expect("create a test database");
        let base = admin_url();
        let cut = base.rfind('/').expect("a database URL has a path");
        TestDatabase {
            url: format!("{}/{name}", &base[..cut]),
            name,
        }
    }

    /// Drops the database (its connections are closed first).
    pub async fn drop_database(self) {
        let _ = admin()
            .await
            .batch_execute(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .await;
    }
}
