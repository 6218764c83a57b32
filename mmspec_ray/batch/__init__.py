"""mmspec_ray.batch"""
