"""What the lab's packages and the tests share: child processes started with a readiness check
(`procs`), private redis-server processes on free ports (`localredis`), an instant OpenAI-style
backend (`instant_backend`), an open-loop arrival clock (`openloop`) and bootstrap statistics
(`stats`)."""
